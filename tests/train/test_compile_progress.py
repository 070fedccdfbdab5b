"""train.program.compile_progress: a compile says that it started, that it goes on, and the next
start says how long the last one took."""

import time

from train.program import compile_progress


def test_a_compile_is_announced_reminded_and_remembered(tmp_path):
    lines = []
    with compile_progress.announced("the train step", lines.append, str(tmp_path), every_s=0.05):
        time.sleep(0.3)
    assert lines[0] == "compiling the train step ..."
    assert any(line.startswith("still compiling the train step: ") for line in lines[1:]), lines
    recorded = compile_progress.last_seconds(str(tmp_path))
    assert 0.25 < recorded < 30

    again = []
    with compile_progress.announced("the train step", again.append, str(tmp_path), every_s=60):
        pass
    assert again == [f"compiling the train step (the last compile of this run took "
                     f"{recorded:.1f}s) ..."]


def test_a_failed_compile_records_nothing_and_no_record_dir_writes_nothing(tmp_path):
    lines = []
    try:
        with compile_progress.announced("the train step", lines.append, str(tmp_path)):
            raise RuntimeError("XLA refused")
    except RuntimeError:
        pass
    assert compile_progress.last_seconds(str(tmp_path)) is None
    with compile_progress.announced("the train step", lines.append, None):
        pass
    assert list(tmp_path.iterdir()) == []
