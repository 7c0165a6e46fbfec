"""What pipeline parallelism adds to a candidate's sums (:func:`.layer_sums.sum_layers`): the
tensors crossing each cut, held by the stages on both sides and sent between their ranks, and the
point-to-point time those sends take in a step."""

from __future__ import annotations

from .comm import collective_time, link_for
from .profile import precision_of
from .setting import LayerChoice, Setting
from .terms import CommTime, RankSums, StageSums


def pipeline_sums(ev, s: Setting, choices: list[LayerChoice], sums: RankSums) -> None:
    """Fill ``sums.pipe`` and ``sums.p2p`` from the tensors crossing each cut
    (:attr:`GraphProfile.crossings`), as the runtime's pipeline stages (``runtime/pp.py``'s
    ``LeanStage``) hold them: the receiving stage a buffer per micro-batch in flight for every
    one (its layers' saved activations point into it), the sending stage its own outputs until
    each micro-batch's backward (the last stage: the model's output, or with the fused head its
    input, which the fused op holds anyway), and a buffer for each gradient coming back to the
    micro-batch in backward. A stage holding a layer that reads a parameter another stage owns
    (a head tied to the embeddings) holds its own copy: in its parameters."""
    prof = ev.prof
    precision = precision_of(s.amp, s.zero_stage)
    scale = s.mb_samples / prof.batch * ev.seq_ratio / s.cp
    stage = [ch.stage for ch in choices]
    rank_of = s.rank_of
    for k in range(1, len(choices)):
        a, b = stage[k - 1], stage[k]
        if a == b:
            continue
        sp_div = s.tp if cut_sharded(ev, s, choices, k) else 1
        sent, send, recv = 0.0, sums.pipe[rank_of(a)], sums.pipe[rank_of(b)]
        for c in prof.crossings[k]:
            nbytes = c.nbytes[precision] * scale / sp_div
            sent += nbytes
            recv["recv"] += nbytes
            if c.saved_in is not None and stage[c.saved_in] == b:
                recv["recv_saved"] += nbytes
            if c.made >= 0 and stage[c.made] == a and (c.saved_in is None
                                                       or stage[c.saved_in] != a):
                send["kept"] += nbytes
            if c.grad:
                send["grad_recv"] += nbytes
                recv["grad_sent"] += nbytes
        # between two stages of one rank nothing is sent (see _stage_cuts)
        if rank_of(a) != rank_of(b):
            sums.p2p.append((rank_of(a), rank_of(b), sent))
    by_stage = {st.stage: st for held in sums.stages for st in held}
    if by_stage:
        _stage_cuts(ev, s, choices, by_stage)
    _last_output(ev, s, choices, sums, by_stage)
    _tied_copies(ev, s, choices, sums, by_stage)


def _last_output(ev, s: Setting, choices: list[LayerChoice], sums: RankSums,
                 by_stage: dict[int, StageSums]) -> None:
    """The last stage keeps the model's output until its backward; fused, the stage returns the
    head's input, which the fused op saves (in the head layer's activations): no logits kept as
    the stage's output."""
    last = len(choices) - 1
    if s.fused_loss and ev.head.layer == last:
        return
    out = ev.choice_terms(last, s, choices[last]).out_bytes
    stage = choices[last].stage
    sums.pipe[s.rank_of(stage)]["kept"] += out
    if by_stage:
        by_stage[stage].pipe["kept"] += out


def _tied_copies(ev, s: Setting, choices: list[LayerChoice], sums: RankSums,
                 by_stage: dict[int, StageSums]) -> None:
    """A tied parameter's copy on each other stage that reads it (runtime/pp_split.py): in that
    stage's parameters."""
    stage = [ch.stage for ch in choices]
    copies = {(stage[i], name): numel / (s.tp if split and choices[i].tp else 1)
              for i, lp in enumerate(ev.prof.layers)
              for name, (numel, split, owner) in lp.borrowed.items()
              if stage[owner] != stage[i]}
    for (st, _), numel in copies.items():
        sums.params[s.rank_of(st)] += numel
        if by_stage:
            by_stage[st].params += numel


def cut_sharded(ev, s: Setting, choices: list[LayerChoice], k: int) -> bool:
    """Whether a pipeline cut before layer ``k`` sends sequence shards: both sides lie in the
    sequence-parallel region (``planner.sp_region.sp_region``), which starts at the first
    block (an embedding before it outputs replicated activations) and takes the TP layers after
    the blocks that SP covers (the final norm and the head read the shards: a
    ``SequenceParallel`` norm, a head with ``input_layouts=Shard(1)``)."""
    if not s.sp or not ev.blocks:
        return False
    first = ev.first_block

    def inside(i: int) -> bool:
        return i in ev.blocks or (i > first and choices[i].tp and ev.prof.sp_covers(i))
    return inside(k - 1) and inside(k)


def _stage_cuts(ev, s: Setting, choices: list[LayerChoice],
                by_stage: dict[int, StageSums]) -> None:
    """:attr:`.terms.StageSums.pipe` of each stage of a multi-stage schedule, as
    :func:`pipeline_sums` counts a rank's. Between two stages of one rank (the V's turn) nothing
    is sent: torch's ``set_local_fwd_input`` hands the next stage the output itself (which the
    first keeps, and which the second's layers may save: counted once) and
    ``set_local_bwd_input`` the input's gradient itself, as the first stage's gradient
    buffer."""
    precision = precision_of(s.amp, s.zero_stage)
    scale = s.mb_samples / ev.prof.batch * ev.seq_ratio / s.cp
    stage = [ch.stage for ch in choices]
    for k in range(1, len(choices)):
        a, b = stage[k - 1], stage[k]
        if a == b:
            continue
        local = s.rank_of(a) == s.rank_of(b)
        by_stage[a].sends, by_stage[a].turn = not local, local
        send, recv = by_stage[a].pipe, by_stage[b].pipe
        sp_div = s.tp if cut_sharded(ev, s, choices, k) else 1
        for c in ev.prof.crossings[k]:
            nbytes = c.nbytes[precision] * scale / sp_div
            recv["recv"] += 0.0 if local else nbytes
            if c.saved_in is not None and stage[c.saved_in] == b:
                recv["recv_saved"] += nbytes
            mine = c.made >= 0 and stage[c.made] == a
            if mine and (c.saved_in is None or stage[c.saved_in] != a):
                send["kept"] += nbytes
            if c.grad:
                send["grad_recv"] += nbytes
                recv["grad_sent"] += 0.0 if local else nbytes


def pipeline_comm(ev, s: Setting, sums: RankSums, comm: CommTime) -> float:
    """Point-to-point sends between stages: fill/drain on the critical path, the rest mostly
    hidden (and slowing the compute it hides behind), and each micro-batch's wait for the other
    stage's process where the preset has one (``Factors.pp_handoff_s``). Adds to ``comm``;
    returns the exposed seconds.

    Each cut costs its own bytes: the cut after an embedding carries its replicated output,
    those between blocks under SP a shard (:func:`cut_sharded`), so pricing every send at the
    largest cut would overcharge the rest by up to the TP degree. A rank's share is the sends it
    issues (links are full duplex: what it receives travels the other way at the same time): its
    activations over its outgoing cuts and the gradients over its incoming ones; the busiest
    rank's sum counts. Fill and drain pass the first ``pp - 1`` cuts once each way."""
    if s.pp <= 1:
        return 0.0
    f = ev.f
    pp_link = link_for(ev.cluster, size=s.pp, stride=s.tp * s.replicas)
    hops = [(a, b, collective_time("send_recv", nbytes, 2, pp_link, f.eff_link))
            for a, b, nbytes in sums.p2p]
    # per rank, one micro-batch: its activations forward, the gradients of its inputs back
    sends = [0.0] * s.pp
    for a, b, t in hops:
        sends[a] += t
        sends[b] += t
    total = s.micro_batches * max(sends)
    # the first micro-batch's way out, the last one's way back
    fill = 2 * sum(t for _, _, t in hops[:s.pp - 1])
    # never hidden; no stage-count factor: see Factors
    wait = s.micro_batches * s.virtual_stages * f.pp_handoff_s
    return comm.record("send_recv", total + wait, fill + (1 - f.overlap_pp) * total + wait,
                       f.overlap_contention)
