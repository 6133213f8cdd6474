"""``bpslaunch --stages``: the stage lists core/stages.py builds, as core/stages.py's docstring promises."""
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
