"""The memory moments of a pipeline rank that holds several stages (interleaved 1F1B, looped BFS,
interleaved zero bubble, ZBV): at each of its actions (:func:`.schedule.rank_states`), each of its
stages holds the micro-batches in flight there, whatever the others hold.

A stage of such a rank keeps a micro-batch's saved activations, its input buffer and its output from
the micro-batch's forward to its backward (torch's ``_PipelineScheduleRuntime`` runs the actions in
the rank's order; ``runtime/pp.py``'s ``LeanStage`` frees a buffer when its backward is done and
lets the send of its output go then), and the input gradient it sent until a lower stage of the rank
runs that micro-batch's backward (``runtime/pp.py``'s ``Sends``; on the rank's lowest stage, until
the step ends). Under
a zero-bubble schedule a backward is split: the input pass (``stage_backward_input``) computes the
input's gradient with ``retain_graph=True``, so every saved activation of the micro-batch stays
until the weight pass, beside the gradients hooked for it
(:attr:`~.profile.LayerProfile.weight_pass`), the gradient received for the output and the input's
gradient (``inp.grad``, dropped by ``LeanStage`` after the weight pass)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..plan import ITEMSIZE
from .alike import own_weight
from .memory import accumulating_op
from .moment import PeakMoment, fsdp_buffers
from .schedule import ZERO_BUBBLE, Held, rank_states, state_arrays
from .terms import FsdpUnit, StageSums


class _Around(NamedTuple):
    """What the rank's other micro-batches and stages hold at one action."""

    terms: dict[str, float]
    grads: float
    """gradient bytes (the ``grads`` field; a pipelined FSDP stage's are a term instead)"""
    total: float
    """both"""
    action: str | None = None
    """the running action's kind and micro-batch (:meth:`StagedRank.micro_batch`)"""
    micro_batch: int | None = None

    def moment(self, phase: str, layer: int | None, grads: float, parts: tuple[dict, ...],
               op: int | None = None, later: bool | None = None) -> PeakMoment:
        """A moment holding this, ``grads`` gradient bytes more and the terms of ``parts``."""
        weight = self.total + grads + sum(sum(p.values()) for p in parts)
        return PeakMoment(phase, layer, self.grads + grads, (self.terms, *parts), weight, op, later,
                          self.action, self.micro_batch)


class StagedRank:
    """The moments of rank ``r`` of a multi-stage schedule (``RankMemory.moments``)."""

    def __init__(self, mem, r: int, st, states: tuple[Held, ...] | None = None):
        s, sums = mem.s, mem.sums
        self.mem, self.r, self.st = mem, r, st
        # ``states``: some of them, to weigh those alone (``floor.memory_floor``)
        self.states = states or rank_states(s.schedule, pp=s.pp, rank=r,
                                            micro_batches=s.micro_batches,
                                            virtual_stages=s.virtual_stages)
        v = len(self.states[0].full)
        # a stage without layers holds nothing (the schedule still runs it)
        self.stages: list[StageSums] = [*sums.stages[r], *(StageSums(-1, 0.0, 0.0)
                                                          for _ in range(v - len(sums.stages[r])))]
        self.layers: list[list[tuple]] = [[] for _ in range(v)]
        for e in sums.bwd_layers[r]:
            self.layers[sums.local[e[3]]].append(e)
        self.inputs: list[list] = [[] for _ in range(v)]
        for e in sums.input_layers[r]:
            self.inputs[sums.local[e.layer]].append(e)
        self.units: list[list[FsdpUnit]] = [[] for _ in range(v)]
        for u in sums.units[r]:
            self.units[sums.local[u.first]].append(u)
        self.idle: dict[tuple, tuple[float, tuple]] = {}
        self.accumulating: dict[int, tuple] = {}  # id of a run's op deltas -> its accumulating_op
        # local stage -> its id among the stages alike (.alike.own_weight)
        self.alike: dict[int, int] = {}
        last = s.pp * s.virtual_stages - 1
        self.loss_at = next((k for k, x in enumerate(self.stages) if x.stage == last), None)

    def moments(self, per_op: bool) -> list:
        """Every moment of the rank's step that can be its heaviest: at each state, its running
        stage's layers."""
        out = []
        for h, around in self._heaviest_states():
            out += self._state_moments(h, around._replace(action=h.kind,
                                                          micro_batch=self.micro_batch(h)), per_op)
        return out

    def heaviest(self) -> PeakMoment | None:
        """The first of :meth:`moments`' heaviest (``per_op`` False), the very same moment, without
        weighing every state's rest one by one: each group of alike states
        (:meth:`_heaviest_states`) is bounded by its rest's total as arrays (:meth:`_near_heaviest`)
        plus its running stage's heaviest moment weighed on an empty rest
        (:func:`.alike.own_weight`: once for the stages alike on every rank), and only the groups
        whose bound is within rounding of the largest are weighed as :meth:`moments` weighs them, in
        its order. None where the rank has no such moment."""
        if len(self.states) <= 16:
            return max(self.moments(False), key=lambda mo: mo.weight, default=None)
        groups, most = self._near_groups()
        bounds = []
        for members, t in zip(groups, most, strict=True):
            h = self.states[members[0]]
            bounds.append(t + self._own_output(h) + own_weight(self, h))
        top = max(bounds, default=-np.inf)
        if top == -np.inf:
            return None
        bar = top - 1e-9 * abs(top) - 1e-6
        best = None
        for members, bound in zip(groups, bounds, strict=True):
            if bound < bar:
                continue
            h, around = self.states[members[0]], self._around(self.states[members[0]])
            for i in members[1:]:
                rest = self._around(self.states[i])
                if rest.total > around.total:
                    h, around = self.states[i], rest
            around = around._replace(action=h.kind, micro_batch=self.micro_batch(h))
            for mo in self._state_moments(h, around, False):
                if best is None or mo.weight > best.weight:
                    best = mo
        return best

    def _near_groups(self) -> tuple[list[list[int]], list[float]]:
        """The states :meth:`_near_heaviest` keeps, by group of alike states (:meth:`_group`), the
        groups in the order of their first such state, each as its states' indices in order; and
        each group's largest rest (:meth:`rest_totals`)."""
        a = state_arrays(self.states)
        total = self.rest_totals()
        keep = self._near(a, total)
        g = a.groups[keep]
        by = np.argsort(g, kind="stable")  # each group's states together, in order
        starts = np.flatnonzero(np.diff(g[by], prepend=-1))
        most = np.maximum.reduceat(total[keep][by], starts).tolist()
        kept, ends = keep[by].tolist(), [*starts.tolist(), len(keep)]
        # the groups in the order of their first kept state
        first = np.argsort(keep[by][starts], kind="stable").tolist()
        return [kept[ends[i]:ends[i + 1]] for i in first], [most[i] for i in first]

    def own_afresh(self, h: Held) -> float:
        """The heaviest weight of state ``h``'s own moments (per layer) with nothing else held, -inf
        where it has none, weighed afresh: :func:`.alike.own_weight` shares it between the stages
        alike."""
        return max((mo.weight for mo in self._state_moments(h, _Around({}, 0.0, 0.0), False)),
                   default=-np.inf)

    def _state_moments(self, h: Held, around: _Around, per_op: bool) -> list:
        """State ``h``'s moments with ``around`` the rest of the rank: its running stage's
        layers."""
        if h.kind == "F":
            return self._layers(h, around, "forward", per_op)
        if h.kind == "B":
            return self._layers(h, around, "backward", per_op) + self._loss(h, around)
        if h.kind == "I":
            return self._input(h, around, per_op) + self._loss(h, around)
        if h.kind == "W":
            return self._weight(h, around)
        return [self._reduce(h, around)] if self.st.pipelined else []

    def micro_batch(self, h: Held) -> int | None:
        """The micro-batch (from 0) whose action ``h`` is, from the counts it holds (a state keeps
        no micro-batch: states alike merge); None at a reduction. A stage runs its forwards, and its
        backwards or input passes, in micro-batch order (looped BFS its backwards from the last),
        its weight passes in their input passes' order (a first stage's, a "B" under a zero-bubble
        schedule, too)."""
        k, s = h.local, self.mem.s
        if h.kind == "F":
            return h.forwarded[k]
        if h.kind == "W" or (h.kind == "B" and s.schedule in ZERO_BUBBLE):
            return h.backwarded[k] - h.waiting[k] - 1
        if h.kind in ("B", "I"):
            return (s.micro_batches - h.backwarded[k] if s.schedule == "looped_bfs"
                    else h.backwarded[k] - 1)
        return None

    def _heaviest_states(self):
        """Each state with what the rest of the rank holds then (:meth:`_around`), of the states
        whose running stage's moments are alike (the same action on the same stage, with that
        stage's gradients, units and weight-pass leftovers in the same state, for the same
        micro-batch kind) the one whose rest holds the most: their moments differ by that rest
        alone, so the others' are lighter at every layer and op, and a rank costs O(states +
        layers), not their product. The rests are weighed at once, as arrays (:meth:`_rest_totals`);
        only the states within rounding of their group's heaviest are weighed again one by one, as
        before."""
        best: dict[tuple, tuple[Held, _Around]] = {}
        near = self._near_heaviest() if len(self.states) > 16 else self.states
        for h in near:
            around, key = self._around(h), self._group(h)
            if key not in best or around.total > best[key][1].total:
                best[key] = h, around
        return best.values()

    @staticmethod
    def _group(h: Held) -> tuple:
        """What states whose running stage's moments are alike share (:meth:`_heaviest_states`)."""
        k = h.local
        return h.kind, k, h.grads[k], h.backward_last[k], h.weight_passed[k], h.later

    def _near_heaviest(self) -> list[Held]:
        """The states whose rest (:meth:`_around`'s total, summed here as arrays) is within rounding
        of the heaviest of their group's (:meth:`_heaviest_states`), in order."""
        keep = self._near(state_arrays(self.states), self.rest_totals())
        return [self.states[i] for i in keep.tolist()]

    @staticmethod
    def _near(a, total: np.ndarray) -> np.ndarray:
        """The indices of the states whose rest ``total`` is within rounding of their group's
        heaviest, in order (``a``: the states' :func:`.schedule.state_arrays`)."""
        bar = np.maximum.reduceat(total[a.order], a.starts)[a.groups]
        return np.flatnonzero(total >= bar - 1e-9 * np.abs(bar) - 1e-6)

    def rest_totals(self) -> np.ndarray:
        """Per state (the rows of :func:`.schedule.state_arrays`): :meth:`_around`'s total less the
        running stage's own output (:meth:`_own_output`), summed as arrays (so equal to it but for
        rounding)."""
        a = state_arrays(self.states)
        m = self.mem.s.micro_batches
        v = len(self.stages)
        # per micro-batch in flight, waiting for its weight pass, of a sent input gradient
        per = np.zeros(3 * v)
        const = sum(self.st.held.values())
        for j, x in enumerate(self.stages):
            p = x.pipe
            per[j] = x.acts - p["recv_saved"] + p["recv"] + (0.0 if x.turn else p["kept"])
            per[v + j] = (0.0 if x.turn else p["grad_recv"]) + self._kept(j)
            per[2 * v + j] = p["grad_sent"]
            const += m * (p["kept"] + p["grad_recv"]) if x.turn else 0.0
        # (the running stage's own output, alive through its backward, is the same across a group);
        # the other stages' gradients, units and weight-pass leftovers (the running one's are its
        # moments')
        others = self.idle_totals()[a.stage_index, a.codes]
        others[a.running] = 0.0
        return a.counts @ per + others.sum(axis=1) + const

    def rest_changed(self) -> tuple[np.ndarray, np.ndarray]:
        """Per state, as :meth:`rest_totals`: the rest's saved activations and weight-pass gradients
        (:meth:`_around`'s terms that recompute and a layer's weight-pass choices change)."""
        a = state_arrays(self.states)
        v = len(self.stages)
        acts = np.array([x.acts - x.pipe["recv_saved"] for x in self.stages])
        kept = np.array([self._kept(j) for j in range(v)])
        return a.counts[:, :v] @ acts, a.counts[:, v:2 * v] @ kept

    def _own_output(self, h: Held) -> float:
        """The running stage's own output in :meth:`_around` (alive through its backward where it
        went to another rank), which :meth:`_near_heaviest`'s sums leave out: the same across a
        group."""
        x = self.stages[h.local]
        return x.pipe["kept"] if x.sends and not x.turn and h.kind in "BI" else 0.0

    def idle_totals(self) -> np.ndarray:
        """[local stage, code]: :meth:`_idle`'s bytes in all (its gradient bytes plus its terms, in
        its order: the same floats), for the gradients' state, backward and weight-pass flags packed
        in ``code`` (:func:`.schedule.state_arrays`). Each of its three parts reads one of them, so
        a stage's 12 codes are weighed from 7 parts."""
        g, terms, unsharded, left = [], [], [], []  # by gradients' state; by each flag
        for j, x in enumerate(self.stages):
            by_state = [self._grads(j, state, x.params) for state in range(3)]
            g.append([b for b, _ in by_state])
            terms.append([sum(t.values()) for _, t in by_state])
            unsharded.append([sum(self._unsharded(j, flag).values()) for flag in (False, True)])
            left.append([sum(self._left(j, flag).values()) for flag in (False, True)])
        g, terms, unsharded, left = (np.array(x, dtype=float) for x in (g, terms, unsharded, left))
        code = np.arange(12)
        return g[:, code // 4] + ((terms[:, code // 4] + unsharded[:, code // 2 % 2])
                                  + left[:, code % 2])

    # ---- what the rest of the rank holds ------------------------------------------------------
    def _around(self, h: Held) -> _Around:
        """The other micro-batches of every stage (``h``'s counts) and the other stages' gradients
        and unsharded parameters, with the buffers alive the whole step (``_States.held``)."""
        acts = buffers = outputs = sent = kept = 0.0
        m = self.mem.s.micro_batches
        for j, x in enumerate(self.stages):
            n, p = h.full[j] + h.waiting[j], x.pipe
            acts += n * (x.acts - p["recv_saved"])
            buffers += n * p["recv"] + (0 if x.turn else h.waiting[j] * p["grad_recv"])
            # a stage's output lives to its micro-batch's backward (the runtime lets the send
            # holding it go then, runtime/pp.py Sends), through it where it went to another rank;
            # what it handed to the rank's next stage, and the gradient handed back, until the next
            # step's (StageSums.turn)
            running = x.sends and not x.turn and j == h.local and h.kind in "BI"
            outputs += (m if x.turn else n + running) * p["kept"]
            # an input gradient's send holds it until a lower stage of the rank runs that
            # micro-batch's backward, or to the step's end on the rank's lowest stage (backwards run
            # in the same order on every stage)
            gone = h.backwarded[j - 1] if j else 0
            sent += (h.backwarded[j] - gone) * p["grad_sent"] + (m * p["grad_recv"] if x.turn
                                                                 else 0.0)
            kept += h.waiting[j] * self._kept(j)
        terms = {"saved_activations": acts, "pipeline_buffers": buffers,
                 "pipeline_outputs": outputs, "pipeline_sent_gradients": sent,
                 "weight_pass_gradients": kept, **self.st.held}
        grads = 0.0
        for j in range(len(self.stages)):
            if j != h.local:
                g, others = self._idle(j, h.grads[j], h.backward_last[j], h.weight_passed[j])
                grads += g
                for key, value in others:
                    terms[key] = terms.get(key, 0.0) + value
        return _Around(terms, grads, grads + sum(terms.values()))

    def _idle(self, j: int, grads: int, backward_last: bool, passed: bool) -> tuple[float, tuple]:
        """What stage ``j`` holds while another runs: its gradient bytes, and its gradient, FSDP and
        weight-pass terms (:meth:`_grads`, :meth:`_unsharded`, :meth:`_left`) as (name, bytes);
        the same for every state alike, made once."""
        key = j, grads, backward_last, passed
        if key not in self.idle:
            g, gterms = self._grads(j, grads, self.stages[j].params)
            self.idle[key] = g, (*gterms.items(), *self._unsharded(j, backward_last).items(),
                                 *self._left(j, passed).items())
        return self.idle[key]

    def _kept(self, j: int) -> float:
        """What one micro-batch of stage ``j`` keeps for its weight pass beyond its buffers: its
        layers' hooked gradients, less its output's (the gradient received, whose buffer the last
        residual add hands to the op that made the output). None on the model's first stage, whose
        input pass does nothing."""
        x = self.stages[j]
        if x.stage == 0:
            return 0.0
        return max(x.weight_grads - x.pipe["grad_recv"], 0.0)

    def _grads(self, j: int, state: int, numel: float, *,
               whole: bool = True) -> tuple[float, dict[str, float]]:
        """(gradient bytes, terms) of ``numel`` parameters of stage ``j`` whose gradients are in
        ``state`` (:attr:`.schedule.Held.grads`): a pipelined FSDP stage accumulates them unsharded
        in float32 until its reduction (``fsdp_unsharded_grads``), sharded after it; ``whole``: a
        vocab-split embedding's among them, whole (:attr:`.terms.StageSums.whole_grads`; its
        backward runs last: not among a stage's first backward's later gradients)."""
        st = self.st
        share = st.gb / st.params if st.params else 0.0
        if state == 0 or not numel:
            return 0.0, {}
        if st.pipelined and state == 1:
            extra = self.stages[j].whole_grads if whole else 0.0
            return 0.0, {"fsdp_unsharded_grads": (numel + extra) * ITEMSIZE["float32"]}
        return numel * share, {}

    def _unsharded(self, j: int, backward_last: bool) -> dict[str, float]:
        """FSDP's unsharded parameters of a stage not running: under ZeRO 2 every unit from the
        step's first unshard (the schedule's ``UNSHARD`` of each stage) to its end, under ZeRO 3
        each unit from a backward (which does not reshard in a pipeline) to its next forward."""
        st = self.st
        if st.fsdp_stage < 2 or not (st.fsdp_stage == 2 or backward_last):
            return {}
        return {"fsdp_unsharded_params": sum(u.numel for u in self.units[j]) * st.p_item}

    def _left(self, j: int, passed: bool, layer: int | None = None) -> dict[str, float]:
        """The weight gradients stage ``j``'s last weight pass (``passed``) left on FSDP's 16-bit
        unsharded parameters: that pass runs none of FSDP's hooks, so they stay there, beside
        FSDP's float32 accumulation (``fsdp_unsharded_grads``), until the stage's next input pass
        hands each unit's over after its backward (during that pass at ``layer``, those of the
        units after it are gone). None in float32, where the pass adds to that accumulation."""
        st = self.st
        if not (passed and st.pipelined and st.p_item != ITEMSIZE["float32"]):
            return {}
        done = sum(u.numel for u in self.units[j] if layer is not None and u.first > layer)
        return {"fsdp_weight_pass_grads": (self.stages[j].params - done) * st.p_item}

    # ---- the running stage --------------------------------------------------------------------
    def _running(self, h: Held, *, output_grad: bool) -> dict[str, float]:
        """The running micro-batch's buffers on its stage: its input's, its output, and the
        gradient received for the output (``output_grad``)."""
        x = self.stages[h.local]
        p = x.pipe
        grad = p["grad_recv"] if output_grad and not x.turn else 0.0
        return {"pipeline_buffers": p["recv"] + grad,
                "pipeline_outputs": 0.0 if x.sends or x.turn else p["kept"]}

    def _layers(self, h: Held, around: _Around, phase: str, per_op: bool) -> list:
        """The running stage's forward (``phase`` "forward") or backward and recompute moments:
        its layers' entries (:attr:`.terms.RankSums.bwd_layers`) counted from the stage's start."""
        k, st = h.local, self.st
        x = self.stages[k]
        forward = phase == "forward"
        running = self._running(h, output_grad=not forward)
        if forward:
            running["pipeline_outputs"] = 0.0
        out = []
        # a backward after the stage's first: each op's new gradients are made beside those
        # (memory.accumulating_op)
        item = st.sum_item if h.grads[k] and not forward else 0
        for a, w, before, layer, kind, ops in self.layers[k]:
            if (kind == "forward") != forward:
                continue
            fb = fsdp_buffers(self.units[k], layer, zero_stage=st.fsdp_stage, p_item=st.p_item,
                              g_item=ITEMSIZE["float32"], params=x.params, forward=forward,
                              pipelined=st.pipelined and (h.backward_last[k] or not forward),
                              regathered=h.backward_last[k] and not forward)
            fb = fb | self._left(k, h.weight_passed[k])
            work = "forward_working_set" if forward else "backward_working_set"
            # every gradient exists: the op where the working set, saved bytes and new gradients
            # weigh most (peak.py)
            top = (self._accumulating(ops, item) if h.grads[k] and not forward
                   else (None, 0.0, 0.0, 0.0, 0.0))
            for op, dw, da, dbefore, made in (top, *(ops if per_op else ())):
                later = 0.0 if forward else x.params - (before - x.params_start) - dbefore
                # before the stage's first backward ends, only the parameters read after this op
                grads, gterms = (self._grads(k, h.grads[k], x.params) if h.grads[k]
                                 else self._grads(k, 1, later, whole=False))
                mine = {"saved_activations": a - x.acts_start - x.pipe["recv_saved"] + da,
                        work: w + dw} | ({"new_weight_gradients": made * item} if item else {}) | (
                    self.mem.received(self.r, layer, kind))
                out.append(around.moment(kind, layer, grads, (mine, running, fb, gterms), op,
                                         h.later))
        return out

    def _accumulating(self, ops: tuple, item: int) -> tuple:
        """:func:`.memory.accumulating_op` of a run's op deltas, made once (every state weighs
        it)."""
        hit = self.accumulating.get(id(ops))
        if hit is None:
            hit = self.accumulating[id(ops)] = accumulating_op(ops, item)
        return hit

    def _input(self, h: Held, around: _Around, per_op: bool) -> list:
        """The running stage's input pass at each of its layers (``RankSums.input_layers``):
        every saved activation of the micro-batch alive (nothing is freed with ``retain_graph``),
        the gradients kept for the weight pass by the layers after it, and at the layer's ops their
        gradients and those kept so far (the output's gradient among them: its buffer is counted
        there). No parameter gradient is made."""
        k, st = h.local, self.st
        x = self.stages[k]
        running = self._running(h, output_grad=False)
        grads, gterms = self._grads(k, h.grads[k], x.params)
        out = []
        for e in self.inputs[k]:
            fb = fsdp_buffers(self.units[k], e.layer, zero_stage=st.fsdp_stage, p_item=st.p_item,
                              g_item=ITEMSIZE["float32"], params=x.params, pipelined=st.pipelined,
                              regathered=h.backward_last[k])
            fb = fb | self._left(k, h.weight_passed[k], e.layer)
            for op, dw in ((None, 0.0), *(e.ops if per_op else ())):
                mine = {"saved_activations": x.acts - x.pipe["recv_saved"],
                        "backward_working_set": e.work + dw,
                        "weight_pass_gradients": x.weight_grads - e.kept_upto}
                parts = (mine, running, fb, gterms, self._loss_kept(k, mine))
                out.append(around.moment("backward", e.layer, grads, parts, op, h.later))
        return out

    def _loss_kept(self, k: int, mine: dict[str, float]) -> dict[str, float]:
        """On the last stage, what its input pass keeps of the loss: the log-softmax the loss saved
        (its graph is retained too), and the logits' gradient, the first kept for the weight pass
        (moved out of ``mine``'s: made by the loss's backward, outside the model)."""
        if k != self.loss_at or not self.mem.loss_applies():
            return {}
        logits = min(self.stages[k].pipe["kept"], mine["weight_pass_gradients"])
        mine["weight_pass_gradients"] -= logits
        saved = self.mem.loss_terms(self.st)["loss_saved"]
        return {"loss_saved": saved, "loss_temporaries": logits}

    def _weight(self, h: Held, around: _Around) -> list:
        """The running stage's weight pass as it starts (at each layer of the stage: the pass runs
        through all of them): the micro-batch's saved activations, buffers and kept gradients."""
        k = h.local
        x = self.stages[k]
        running = self._running(h, output_grad=True)
        grads, gterms = self._grads(k, h.grads[k], x.params)
        mine = {"saved_activations": x.acts - x.pipe["recv_saved"],
                "weight_pass_gradients": self._kept(k)}
        parts = (mine, running, gterms, self._unsharded(k, True), self._left(k, h.weight_passed[k]))
        return [around.moment("backward", e.layer, grads, parts, None, h.later)
                for e in self.inputs[k]]

    def _loss(self, h: Held, around: _Around) -> list:
        """The loss's backward, at the start of the last stage's backward (or input pass): the
        micro-batch's saved activations, the loss's (``RankMemory.loss_terms``)."""
        k = h.local
        if k != self.loss_at or not self.mem.loss_applies():
            return []
        x = self.stages[k]
        loss = {"saved_activations": x.acts - x.pipe["recv_saved"], **self.mem.loss_terms(self.st)}
        if self.st.fsdp_stage == 2:
            loss["fsdp_unsharded_params"] = sum(u.numel for u in self.units[k]) * self.st.p_item
        grads, gterms = self._grads(k, h.grads[k], x.params)
        parts = (loss, self._running(h, output_grad=False), gterms,
                 self._left(k, h.weight_passed[k]))
        return [around.moment("loss", None, grads, parts, later=h.later)]

    def _reduce(self, h: Held, around: _Around):
        """A pipelined FSDP stage's reduction after its last backward (``REDUCE_GRAD``): its
        gradients still unsharded, its units too, and its first group's reduce-scatter input."""
        k = h.local
        x = self.stages[k]
        units = self.units[k]
        first = (x.params - sum(u.numel for u in units)) or (units[0].numel if units else 0.0)
        g_item = ITEMSIZE["float32"]
        mine = {"fsdp_unsharded_grads": (x.params + x.whole_grads) * g_item,
                "fsdp_reduce_scatter": first * g_item}
        return around.moment("reduce", None, 0.0, (mine, self._unsharded(k, True)))
