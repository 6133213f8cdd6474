"""``bpslaunch --stages``: the stage lists core/stages.py builds, as core/stages.py's docstring promises."""
import itertools

from byteps import launcher
from byteps.core import stages
from byteps.core.stages import Stage


def test_stages_prints_every_situation(capsys, monkeypatch):
    monkeypatch.delenv("BYTEPS_PIPELINE", raising=False)
    assert launcher.main(["--stages", "--local-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "4 processes per machine" in out
    rows = dict(stages.situations(4))
    for what, st in rows.items():
        assert f"{what}" in out and stages.describe(st) in out
    assert rows["one process per machine, colocated server"] == (Stage.STAGE, Stage.PUSH, Stage.PULL)
    assert rows["4 processes per machine, push_pull, not the owner"] == (Stage.COORDINATE, Stage.LOCAL_BROADCAST)
    assert rows["broadcast (other ranks: empty body), colocated server"] == (Stage.PUSH, Stage.PULL)


def test_stages_apply_byteps_pipeline(capsys, monkeypatch):
    monkeypatch.setenv("BYTEPS_PIPELINE", "-stage,-local_reduce")
    assert launcher.main(["--stages"]) == 0
    out = capsys.readouterr().out
    assert "drops local_reduce, stage" in out and "STAGE" not in out.split("\n  CUDA")[0].replace("stage lists", "")
    rows = dict(stages.situations(2, stages.from_env()))
    assert rows["2 processes per machine, push_pull, partition owner"] == (Stage.PUSH, Stage.PULL)
    monkeypatch.setenv("BYTEPS_PIPELINE", "-push")
    assert launcher.main(["--stages"]) == 2
    assert "cannot be dropped" in capsys.readouterr().err


def test_one_numbering_for_native_core_python_and_timeline():
    """core/pipeline/bps_stages.h, byteps.core.stages.Stage and the timeline's span kinds are one list."""
    from byteps.core import _pipeline
    from byteps.timeline import spans
    assert _pipeline.stage_names() == {s.value: s.name for s in Stage}
    assert spans.STAGES == _pipeline.stage_names()
    assert set(spans.MEANING) == set(spans.STAGES.values())


def _roles(**extra):
    """Every combination of op kind, owner, local reduce, colocated server and machine count (and the
    choices in ``extra``), as stage_list()'s keyword arguments on a machine of 2 processes."""
    axes = {"kind": ("push_pull", "broadcast", "async push_pull"), "owner": (True, False),
            "local_reduce": (True, False), "colocated": (True, False), "machines": (1, 2), **extra}
    for values in itertools.product(*axes.values()):
        yield dict(zip(axes, values), local_size=2)


def test_stage_lists_come_from_the_native_rule():
    """stages.stage_list() is bps_stage_list(): every combination, against the rule written out here."""
    S = Stage
    for args in _roles():
        got = stages.stage_list(**args)
        if args["kind"] == "push_pull" and args["local_reduce"]:
            want = ((S.COORDINATE, S.LOCAL_BROADCAST) if not args["owner"] else
                    (S.LOCAL_REDUCE,) + (() if args["machines"] == 1 else (S.PUSH, S.PULL)) + (S.LOCAL_BROADCAST,))
        else:
            want = ((S.STAGE,) if args["colocated"] else ()) + (S.PUSH, S.PULL)
        assert got == want, args
    # one process on its machine never reduces locally, and GPU stages go around the host stages
    assert stages.stage_list(owner=True, local_size=1, local_reduce=True, colocated=False) == (S.PUSH, S.PULL)
    assert stages.stage_list(owner=True, local_size=1, local_reduce=False, colocated=False,
                             device="cuda") == (S.COPYD2H, S.PUSH, S.PULL, S.COPYH2D)


def test_cuda_stage_lists_copy_around_the_host_stages():
    """A CUDA tensor's partition: COPYD2H first and COPYH2D last around the host stages for every role,
    except a broadcast's root (nothing comes back) and its other ranks (nothing to send)."""
    S = Stage
    for args in _roles(root=(True, False)):
        host = stages.stage_list(**args)
        got = stages.stage_list(device="cuda", **args)
        before = () if args["kind"] == "broadcast" and not args["root"] else (S.COPYD2H,)
        after = () if args["kind"] == "broadcast" and args["root"] else (S.COPYH2D,)
        assert got == before + host + after, args
