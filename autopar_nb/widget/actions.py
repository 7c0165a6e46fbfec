"""What the Verify / Export / Launch / Tournament buttons run on and say: the processes a plan runs
on here, when a button must wait for another's processes, the message for what ``ap.<action>()``
returned (led by one line when the plan ran at another process count than it was made for), and the
calibration the header names."""

from __future__ import annotations

from typing import Any

from .. import calibration
from ..launch import launcher
from ..launch.trials import machine_mismatch
from ..plan import Plan


def local_nproc(plan: Plan) -> int:
    """Processes for the Verify/Launch buttons on this machine: the plan's world size when this
    machine has that many GPUs, else one model-parallel replica (tp * pp), times the data-parallel
    replicas that fit (2 on CPU)."""
    import torch

    avail = torch.cuda.device_count() if torch.cuda.is_available() else 2
    world, mp = plan.mesh.world_size, plan.mesh.tp * plan.mesh.pp
    if world <= avail:
        return world
    return mp * max(1, min(plan.mesh.dp, avail // mp))


def refusal(name: str, jobs: dict[str, Any], cluster: Any = None) -> str:
    """Why the button ``name`` may not start now ("" when it may): a tournament measures step times,
    so nothing else runs processes beside its trials (they would measure each other), and it does
    not start beside a launched run or a Verify, or on a machine without the plans' devices.
    ``jobs``: the widget's last background jobs by button ("verify", "tournament"); ``cluster``: the
    session's."""
    if name not in ("verify", "launch", "tournament"):
        return ""
    if name == "tournament" and machine_mismatch(cluster):
        return machine_mismatch(cluster)
    job = jobs.get("tournament")
    if job is not None and not job.done:
        return (f"a tournament is running ({job.message}); its trials measure step times, which "
                f"the {name} would slow down. Wait for it (its standings below say when it ends) "
                "or press its Stop")
    if name != "tournament":
        return ""
    alive = launcher.live_runs()
    if alive:
        r = alive[0]
        return (f"a launched run is {r.status} (run {r.run_id[:8]}, {r.nproc} processes): the "
                "tournament's trials would share this machine with it and measure each other. Stop "
                "it (the dashboard's Stop, or run.stop()) or let it finish, then press Tournament "
                "again")
    verify = jobs.get("verify")
    if verify is not None and not getattr(verify, "done", True):
        return ("a Verify is running: the tournament's trials would share this machine with it. "
                "Let it finish (or press its Stop), then press Tournament again")
    return ""


def calibrated_badge(cluster: Any) -> dict[str, str]:
    """{"text": "calibrated on <date> from N runs", "title": where the factors are and how to forget
    them} when ``cluster`` plans with measured step-time factors (``calibration.apply``, or a
    tournament of this session); {} with the cost model's defaults."""
    held = getattr(cluster, "calibration", None) or {}
    preset = getattr(cluster, "name", "") or ""
    if not any(k in held for k in calibration.SPEED_KEYS):
        return {}
    text = calibration.speed_badge(preset)
    return {"text": text, "title": calibration.speed_text(preset)} if text else {}


def run_kwargs(name: str, params, plan: Plan | None, options: dict) -> dict:
    """``nproc`` and ``steps`` for ``ap.verify``/``ap.launch`` (those of ``params``, the function's
    parameters) from the widget's processes/steps inputs, ``options`` (the run_options trait); the
    defaults where an input is empty."""
    kwargs = {}
    if name in ("verify", "launch") and plan is not None and "nproc" in params:
        kwargs["nproc"] = int(options.get("nproc") or local_nproc(plan))
    if name in ("verify", "launch") and "steps" in params:
        kwargs["steps"] = int(options.get(f"{name}_steps") or (5 if name == "verify" else 50))
    return kwargs


def scaled_line(plan: Any) -> str:
    """The line a plan scaled to another process count carries (``Session.plan_for``: what was
    planned, what runs, what to do), "" for a plan run as it was made."""
    if plan is None or not (getattr(plan, "cluster", None) or {}).get("scaled_from"):
        return ""
    return (plan.explanation or [""])[0]


def action_message(name: str, result: Any, kwargs: dict | None = None, ran: Any = None,
                   *notes: str) -> tuple[str, str, str]:
    """(level, text, detail) for the result of ``ap.<name>()``: the exported script's path and
    torchrun commands, the verify report or job, or the run. ``ran`` is the plan that ran: scaled to
    another process count, its line leads the text and the level is "warning" (the run is not the
    plan as made, and the user did not ask to re-plan); ``notes`` (a re-plan for the steps launched)
    lead it likewise."""
    args = ", ".join(f"{k}={v!r}" for k, v in (kwargs or {}).items())
    script = getattr(result, "script", None)
    if name == "export" and script is not None:
        cmds = list(getattr(result, "commands", []) or [])
        text, detail = (f"Exported {script} (the plan beside it: "
                        f"{getattr(result, 'plan_json', '')}). Open it in a cell with %load "
                        f"{script}", "\n".join(cmds))
    elif name == "launch":
        text, detail = (f"ap.launch({args}): the live dashboard is below; the Run is "
                        "ap.widget().last_result (.wait(), .stop(), .samples, .metrics)",
                        repr(result))
    elif name == "tournament":
        text, detail = (f"ap.tournament({args}) runs in the background: its standings are below "
                        "(ap.widget().last_result.wait() returns the TournamentResult)", "")
    elif name == "verify" and hasattr(result, "view"):
        text, detail = (f"ap.verify({args}) runs in the background: its progress is below "
                        "(ap.widget().last_result.wait() returns the VerifyReport)", "")
    else:
        first, _, detail = str(result).partition("\n")
        text = f"ap.{name}(): {first}"
    lines = [line for line in (*notes, scaled_line(ran)) if line]
    return ("warning", "\n".join([*lines, text]), detail) if lines else ("info", text, detail)
