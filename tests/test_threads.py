"""Tests of `threads`: a host computation uses the idle cores."""

from otclr_jax import threads


def test_host_threads_are_the_idle_cores_unless_a_variable_sets_them(
    monkeypatch):
  for name in threads.THREAD_VARIABLES:
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setattr(threads.os, 'sched_getaffinity', lambda pid: {0, 1, 2},
                      raising=False)
  monkeypatch.setattr(threads, '_running_elsewhere', lambda: 1)
  assert threads.host_threads() == 2
  monkeypatch.setattr(threads, '_running_elsewhere', lambda: 5)
  assert threads.host_threads() == 1
  monkeypatch.setenv('OPENBLAS_NUM_THREADS', '3')
  assert threads.host_threads() is None

