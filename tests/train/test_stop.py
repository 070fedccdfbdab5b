"""train.process.stop: every process stops after the same step, agreed through the key-value store
without a per-step collective. Two processes are simulated against one in-memory store, in the
order the trainer's collectives allow; the real store's semantics are checked in
test_peers_jax.py."""

import signal

import pytest

from train.process.stop import LEAD, StopRequest


class Store:
    """The two calls train.process.stop makes, with the coordination service's semantics: a set without
    allow_overwrite fails on an existing key; a directory read lists the keys below it."""

    def __init__(self):
        self.data = {}
        self.reads = 0

    def key_value_set(self, key, value, allow_overwrite=False):
        if key in self.data and not allow_overwrite:
            raise RuntimeError(f"ALREADY_EXISTS: key {key} already exists.")
        self.data[key] = value

    def key_value_dir_get(self, directory):
        self.reads += 1
        return [(k, v) for k, v in self.data.items() if k.startswith(directory)]


def _pair():
    """StopRequests of processes 0 and 1 of one run (made in the same order on both)."""
    import train.process.stop

    store = Store()
    generation = train.process.stop._generation
    a = StopRequest(client=store)
    train.process.stop._generation = generation  # process 1 makes its first StopRequest too
    b = StopRequest(client=store)
    assert a.key == b.key
    return store, a, b


def test_a_signal_on_one_process_stops_both_after_the_same_step():
    store, a, b = _pair()
    for step in range(1, 4):
        assert not a.should_stop(step) and not b.should_stop(step)
    b.requested = "SIGTERM"  # while both decide about step 4; b is ahead of a by a step
    assert not b.should_stop(4)  # proposes 4 + LEAD
    assert not a.should_stop(4)
    stops = {}
    for step in range(5, 10):
        for name, p in (("b", b), ("a", a)):
            if name not in stops and p.should_stop(step):
                stops[name] = step
    assert stops == {"a": 4 + LEAD, "b": 4 + LEAD}
    assert a.stopped and b.stopped and a.requested is None
    assert store.reads == 2 * 4  # one small read per step and process, none once agreed


def test_signals_on_both_processes_agree_on_the_first_proposal():
    _, a, b = _pair()
    a.requested = b.requested = "SIGINT"
    assert not a.should_stop(7)  # stored first: 7 + LEAD
    assert not b.should_stop(8)  # its own proposal (8 + LEAD) fails; it adopts a's
    assert a.agreed_step == b.agreed_step == 7 + LEAD


def test_a_proposal_learned_too_late_is_an_error_not_a_silent_split():
    store, a, b = _pair()
    b.requested = "SIGTERM"
    b.should_stop(3)
    with pytest.raises(RuntimeError, match="asked to stop after step 5 but this one learned of it "
                                           "at step 6"):
        a.should_stop(6)  # the trainer's ordering never allows this


def test_one_process_stops_after_the_step_the_signal_arrived_in():
    stop = StopRequest()
    assert stop.client is None  # one process: no store, no exchange
    with stop:
        stop.take_over()  # (the loop calls it once the step has compiled)
        assert not stop.should_stop(1)
        signal.raise_signal(signal.SIGTERM)
        assert stop.requested == "SIGTERM" and stop.should_stop(2)
    assert signal.getsignal(signal.SIGTERM) is not stop._handle  # restored


def test_at_the_end_a_signal_on_any_process_counts():
    stop = StopRequest()
    assert not stop.agree_at_end()
    stop.requested = "SIGINT"
    assert stop.agree_at_end() and stop.stopped
