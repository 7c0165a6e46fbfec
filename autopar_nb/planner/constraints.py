"""User constraints: ``fix`` (global choices) and ``overrides`` (layer-path globs -> per-layer
choices).

``fix`` keys: :data:`autopar_nb.plan.FIX_KEYS` (dp, tp, pp, ep, zero_stage, micro_batches, schedule,
virtual_stages, recompute, amp, sequence_parallel, optimizer) or their aliases (zero, mb, sp).
``overrides`` maps a glob over layer or module paths (``fnmatch``: ``*`` also matches dots) to any
of:

* ``stage``: pipeline stage (layer paths only)
* ``recompute``: none | selective | full (layer paths only)
* ``fsdp``: bool, own FSDP unit or folded into the root (layer paths only)
* ``tp``: a style for every module under the path (colwise | rowwise | sequence_parallel |
  replicate), or an alias: ``"colwise-rowwise"`` (the Linear pair(s) under the path, found by
  dataflow: those reading the replicated input colwise, the one reading the sharded result rowwise),
  ``"vocab"`` (Embedding rowwise = vocab-parallel, output head colwise with ``loss_parallel``).

A glob that names no layer or module raises :class:`PlanError`, as does a choice that cannot apply.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

from ..cost.profile.crossings import pinned_glue, stage_rules
from ..cost.schedule import ZERO_BUBBLE
from ..cost.tp_styles import PROJECTIONS
from ..plan import PINNABLE, RECOMPUTE, TP_STYLES, PlanError, normalize_fix, within

OVERRIDE_KEYS = PINNABLE
TP_ALIASES = ("colwise-rowwise", "vocab")
NORM_TYPES = ("LayerNorm", "RMSNorm", "GroupNorm")


@dataclass
class LayerOverride:
    """What the user pinned for one layer."""

    stage: int | None = None
    recompute: str | None = None
    fsdp: bool | None = None
    tp_styles: dict[str, str] = field(default_factory=dict)
    """module path -> style the user fixed (including "replicate")"""
    needs_tp: bool = False
    """an override asks for a split style: the mesh must have tp > 1"""
    notes: list[str] = field(default_factory=list)

    @property
    def pinned(self) -> list[str]:
        return [k for k in PINNABLE
                if (self.tp_styles if k == "tp" else getattr(self, k) is not None)]


@dataclass
class Constraints:
    """Parsed ``fix`` and ``overrides``."""

    fix: dict
    layers: dict[int, LayerOverride]
    """layer index -> its override"""
    text: list[str]
    """the overrides as the user wrote them, for the explanation"""
    glued: frozenset[int] | None = None
    """the layers no stage may start at where pins move that set (a pinned start the stage as a
    whole makes runnable: :func:`~autopar_nb.cost.profile.crossings.pinned_glue`); None: the
    profile's ``pp_glued``"""

    @property
    def needs_tp(self) -> bool:
        return any(o.needs_tp for o in self.layers.values())


def parse(graph, prof, fix: dict | None, overrides: dict | None) -> Constraints:
    """Check and resolve ``fix`` and ``overrides`` against the graph (module docstring)."""
    fix = normalize_fix(fix)
    paths = [lay.path for lay in graph.layers]
    layers: dict[int, LayerOverride] = {}
    text: list[str] = []
    for pattern, choice in (overrides or {}).items():
        if not isinstance(choice, dict):
            raise PlanError(f"overrides[{pattern!r}] must be a dict like {{'tp': "
                            f"'colwise-rowwise'}}, got {choice!r}")
        bad = set(choice) - set(OVERRIDE_KEYS)
        if bad:
            raise PlanError(f"overrides[{pattern!r}]: unknown key(s) {', '.join(sorted(bad))}; "
                            f"supported: {', '.join(OVERRIDE_KEYS)}")
        text.append(f"{pattern}: " + ", ".join(f"{k}={v!r}" for k, v in choice.items()))
        whole, partial = _match(graph, pattern)
        if not whole and not partial:
            raise PlanError(f"override {pattern!r} names no layer or module; layers are: "
                            f"{_some(paths)}")
        for key in ("stage", "recompute", "fsdp"):
            if key not in choice:
                continue
            if not whole:
                owners = sorted({paths[i] for i, _ in partial})
                raise PlanError(f"override {pattern!r}: {key!r} applies to whole layers, but "
                                f"{pattern!r} matches modules inside layer(s) {_some(owners)}; use "
                                "the layer path")
            val = choice[key]
            if key == "recompute" and val not in RECOMPUTE:
                raise PlanError(f"override {pattern!r}: recompute={val!r}; choose one of "
                                f"{', '.join(RECOMPUTE)}")
            if key == "stage" and (not isinstance(val, int) or val < 0):
                raise PlanError(f"override {pattern!r}: stage must be an integer >= 0, got {val!r}")
            if key == "fsdp" and not isinstance(val, bool):
                raise PlanError(f"override {pattern!r}: fsdp must be True or False, got {val!r}")
            for i in whole:
                setattr(layers.setdefault(i, LayerOverride()), key, val)
        if "tp" in choice:
            _apply_tp(graph, prof, pattern, choice["tp"], whole, partial, layers)
    pins = sorted((i, ov.stage) for i, ov in layers.items() if ov.stage is not None)
    for (i, a), (j, b) in zip(pins, pins[1:], strict=False):
        if b < a:
            raise PlanError(f"stage overrides out of order: {paths[i]} is pinned to stage {a} but "
                            f"the later layer {paths[j]} to stage {b}; pipeline stages run the "
                            "layers in model order")
    glued, why = (pinned_glue(paths, stage_rules(graph), prof.pp_glued, dict(pins)) if pins
                  else (None, ""))
    if why:
        raise PlanError(why)
    _zero_bubble_without_recompute(fix, layers)
    return Constraints(fix, layers, text, glued)


def _zero_bubble_without_recompute(fix: dict, layers: dict[int, LayerOverride]) -> None:
    """A zero-bubble schedule's input pass recomputes a layer and keeps what it re-made for the
    weight pass: there recompute holds more than none (measured on 4 gloo processes, ZeRO-3 dp 2 x
    pp 2 under ZBV: LLaMA 90 MiB a rank with full recompute, 76 without; GPT-2 and Mixtral alike),
    so the two are not planned together."""
    asked = sorted({m for m in (fix.get("recompute"), *(ov.recompute for ov in layers.values()))
                    if m not in (None, "none")})
    if fix.get("schedule") in ZERO_BUBBLE and asked:
        raise PlanError(f"fix schedule={fix['schedule']} with recompute {'/'.join(asked)}: a "
                        "zero-bubble schedule's input pass recomputes a layer and keeps what it "
                        "re-made for the weight pass, so recompute holds more memory than none "
                        "there; drop recompute, or pick 1f1b or interleaved_1f1b")


def _some(items, n: int = 8) -> str:
    items = list(items)
    return ", ".join(items[:n]) + (f", ... ({len(items)} in all)" if len(items) > n else "")


def _match(graph, pattern: str) -> tuple[list[int], list[tuple[int, str]]]:
    """Layers the glob names as a whole, and (layer, module prefix) pairs it names inside a layer.
    Remembered per graph (a captured graph does not change; the widget asks the same patterns on
    every edit)."""
    cache = graph.__dict__.setdefault("_match_cache", {})
    if pattern not in cache:
        if len(cache) > 4096:
            cache.clear()
        whole, partial = _match_layers(graph, pattern)
        cache[pattern] = (tuple(whole), tuple(partial))
    whole, partial = cache[pattern]
    return list(whole), list(partial)


def _match_layers(graph, pattern: str) -> tuple[list[int], list[tuple[int, str]]]:
    whole: list[int] = []
    partial: list[tuple[int, str]] = []
    for i, lay in enumerate(graph.layers):
        # the layer itself, or a container above it ("h" for h.0, h.1, ...)
        parts = lay.path.split(".")
        if any(fnmatch.fnmatchcase(".".join(parts[:k]), pattern) for k in range(1, len(parts) + 1)):
            whole.append(i)
            continue
        prefixes = set()
        for mod in lay.modules:
            if not mod.startswith(lay.path + ".") and lay.path:
                continue
            mparts = mod.split(".")
            for k in range(len(parts) + 1, len(mparts) + 1):
                prefixes.add(".".join(mparts[:k]))
        for pre in sorted(prefixes):
            if fnmatch.fnmatchcase(pre, pattern):
                partial.append((i, pre))
    return whole, partial


def _apply_tp(graph, prof, pattern, style, whole, partial, layers) -> None:
    targets: list[tuple[int, str | None]] = [(i, None) for i in whole] + list(partial)
    # "shared" and "per_head" follow the split of the attention they are part of
    offered = tuple(s for s in TP_STYLES if s not in ("shared", "per_head")) + TP_ALIASES
    if style not in offered:
        raise PlanError(f"override {pattern!r}: tp={style!r}; choose one of "
                        f"{', '.join(map(repr, offered))}"
                        + (f"; a {style!r} module comes with the attention it feeds "
                           "(tp='colwise-rowwise')" if style in ("shared", "per_head") else ""))
    for i, prefix in targets:
        lay = graph.layers[i]
        lp = prof.layers[i]
        mods = [m for m in lay.modules if prefix is None or within(m, prefix)]
        where = prefix or lay.path
        ov = layers.setdefault(i, LayerOverride())
        if style == "colwise-rowwise":
            auto = {m: lp.tp[m] for m in mods if m in lp.tp
                    and graph.layers[i].modules.get(m) in PROJECTIONS}
            kept = [m for m in mods if m in prof.tp_refused]
            if kept and ("colwise" not in auto.values() or "rowwise" not in auto.values()):
                raise PlanError(f"override {pattern!r}: {kept[0]} cannot be split: "
                                f"{prof.tp_refused[kept[0]]}")
            if "colwise" not in auto.values() or "rowwise" not in auto.values():
                raise PlanError(f"override {pattern!r}: tp='colwise-rowwise' needs a Linear pair "
                                f"under {where!r} (one reading the replicated input, one reading "
                                f"its sharded result); found {auto or 'no splittable Linear'}")
            ov.tp_styles.update(auto)
            ov.needs_tp = True
        elif style == "vocab":
            auto = {m: lp.tp[m] for m in mods if m in lp.tp and (
                (lay.modules.get(m) == "Embedding" and lp.tp[m] == "rowwise") or
                (lay.modules.get(m) == "Linear" and lp.vocab and lp.tp[m] == "colwise"))}
            if not auto:
                raise PlanError(f"override {pattern!r}: tp='vocab' applies to an Embedding or to "
                                "the output head (the Linear whose output is the model's output); "
                                f"{where!r} has neither")
            ov.tp_styles.update(auto)
            ov.needs_tp = True
        elif style == "replicate":
            for m in mods:
                ov.tp_styles[m] = "replicate"
        else:
            if not mods:
                raise PlanError(f"override {pattern!r}: no module with parameters under {where!r} "
                                f"to apply tp={style!r} to")
            kinds = NORM_TYPES if style == "sequence_parallel" else (*PROJECTIONS, "Embedding")
            fit = [m for m in mods if lay.modules.get(m) in kinds]
            bags = [m for m in mods if lay.modules.get(m) == "EmbeddingBag"]
            if bags and style != "sequence_parallel":
                raise PlanError(f"override {pattern!r}: {bags[0]} is an nn.EmbeddingBag, which "
                                "PyTorch TP does not shard; keep it 'replicate' (FSDP shards it "
                                "with zero_stage >= 1) or use nn.Embedding")
            if style == "sequence_parallel" and prof.sp_blocker:
                raise PlanError(f"override {pattern!r}: sequence parallelism cannot apply to this "
                                f"model: {prof.sp_blocker}; drop the override")
            if style == "sequence_parallel" and not prof.sp_covers(i):
                raise PlanError(f"override {pattern!r}: {sp_end(prof)}; drop the override")
            if not fit:
                what = "norms (LayerNorm, RMSNorm)" if style == "sequence_parallel" else \
                    "nn.Linear, Hugging Face's Conv1D or nn.Embedding"
                raise PlanError(
                    f"override {pattern!r}: tp={style!r} applies to {what}; {where!r} "
                    f"holds {_some(sorted(set(lay.modules.get(m, '?') for m in mods)))}")
            for m in fit:
                if style == "colwise" and m in prof.tp_refused:
                    raise PlanError(f"override {pattern!r}: {m} cannot be split with tp={style!r}: "
                                    f"{prof.tp_refused[m]}; keep it 'replicate' (or cut its output "
                                    "into pieces that make up the whole, or use separate Linears, "
                                    "in the model)")
                ov.tp_styles[m] = style
            ov.needs_tp = True



def sp_refusal(prof, tp: int, seq_len: int | None) -> str:
    """Why sequence parallelism cannot split the activations over ``tp`` ranks ("" where it can):
    the model's own blocker, or a sequence the ranks cannot share evenly (unequal pieces, which the
    collectives then refuse)."""
    if prof.sp_blocker:
        return prof.sp_blocker
    if seq_len is not None and tp > 1 and seq_len % tp:
        return (f"seq_len {seq_len} does not divide by tp={tp} (each TP rank takes an equal part "
                "of the sequence)")
    return ""


def sp_end(prof) -> str:
    """Why sequence parallelism stops before the model's output ("" where it reaches it): the layer
    after which the runtime gathers the sequence back, and what a shard would run wrong past it."""
    if prof.sp_last is None:
        return ""
    return (f"sequence parallelism ends after {prof.layers[prof.sp_last].path} "
            f"({prof.layers[prof.sp_gather].path} gathers the whole sequence at its input and runs "
            f"replicated) because {prof.sp_end}")


def sequence_parallel(fix: dict, prof, tp: int, *, seq_ratio: float = 1.0) -> tuple[bool, str]:
    """Whether a mesh with ``tp`` gets sequence parallelism (``fix``'s choice, else wherever it
    applies), and why a fixed one cannot on this mesh ("": it can, or is off); :class:`PlanError`
    where the model refuses it whatever the tp. ``seq_ratio``: the planned sequence length over the
    captured one (``plan(seq_len=...)``)."""
    seq_len = None if prof.seq_len is None else round(prof.seq_len * seq_ratio)
    why = sp_refusal(prof, tp, seq_len)
    sp = fix.get("sequence_parallel", tp > 1 and seq_len is not None and not why)
    if not (sp and tp > 1 and why):
        return sp, ""
    why = (f"fix sequence_parallel=True, but sequence parallelism cannot apply: {why}; drop it "
           "from fix")
    if prof.sp_blocker:
        raise PlanError(why + " (TP then all-reduces full activations)")
    return sp, why + " or choose a tp that divides it"


def float8_fix(cons, amp: str) -> str:
    """The fixed recipe ("none" when not fixed); PlanError when the fixed precision cannot take
    it."""
    recipe = cons.fix.get("float8", "none")
    if recipe != "none" and amp != "bf16":
        raise PlanError(f"fix float8={recipe!r} needs amp='bf16' (torchao's float8 matmuls take "
                        f"bf16 inputs), and amp is {amp!r}: fix amp=bf16 as well, or drop float8")
    return recipe


def async_tp_refusal(cluster, *, compiled: bool, tp: int, pp: int = 1) -> str:
    """Why async TP (``plan.async_tp``) cannot run on ``cluster`` with this plan's compile, tp and
    pp ("" when it can): Inductor's micro-pipeline pass rewrites compiled graphs only, over CUDA
    symmetric memory."""
    if cluster.name == "cpu":
        return "symmetric memory needs CUDA (this cluster runs CPU processes over gloo)"
    if not compiled:
        return ("needs torch.compile (Inductor's micro-pipeline pass rewrites compiled graphs), "
                "and compile is off")
    if tp == 1:
        return ("needs tp > 1 (it pipelines TP's all-gathers and reduce-scatters), and this plan "
                "has tp=1")
    return "" if pp == 1 else ("needs compiled blocks, which run with pp=1 only, and this plan has "
                               f"pp={pp}")


def async_tp_modes(cons, cluster, compile_gain: bool) -> tuple[bool, bool]:
    """(async TP fixed on, async TP costed on every mesh with tp > 1 and pp = 1: not fixed, and the
    cluster and compile can take it; ``compile_gain``: compile's default); PlanError with the reason
    when a fixed one cannot."""
    fix = cons.fix
    if "async_tp" not in fix:
        return False, not async_tp_refusal(cluster, compiled=fix.get("compile", compile_gain), tp=2)
    if not fix["async_tp"]:
        return False, False
    why = async_tp_refusal(cluster, compiled=fix.get("compile", True), tp=fix.get("tp", 2),
                           pp=fix.get("pp", 1))
    if why:
        raise PlanError(f"fix async_tp=true: async TP {why}; drop async_tp from fix")
    return True, False


def offload_fix(cons) -> str:
    """The fixed CPU offload (``mesh.offload``; "none" unless fixed); PlanError when the other fixed
    choices cannot take it: FSDP2's ``CPUOffloadPolicy`` offloads FSDP units (ZeRO 2 or 3), verified
    without pipelining."""
    offload, fix = cons.fix.get("offload", "none"), cons.fix
    why = (f"needs FSDP (zero_stage 2 or 3), and zero_stage is {fix.get('zero_stage')}"
           if fix.get("zero_stage", 3) < 2
           else f"runs with pp=1 (not verified under pipelining), and pp is {fix['pp']}"
           if fix.get("pp", 1) > 1 else "")
    if offload != "none" and why:
        raise PlanError(f"fix offload={offload!r}: CPU offload {why}; drop offload from fix")
    return offload
