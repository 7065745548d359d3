"""Every ``cupy.cuda.Event`` made after ``import shmtensor`` records its device, and an event
is sent under its own device's context: asked under another, the driver crashes the
process (issue 26 item 14(d)).  Runs anywhere, with a CuPy-shaped package in a child
process; the GPU tests are in test_cuda_threads.py."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

FAKE_CUPY = {
    "__init__.py": "from . import cuda\n\n\nclass ndarray:\n    pass\n",
    "cuda/__init__.py": "from . import runtime, stream\nfrom .stream import Event\n",
    "cuda/runtime.py": textwrap.dedent("""
        current = 0


        def getDevice():
            return current


        def eventCreateWithFlags(flags):
            return 1000 + current
    """),
    "cuda/stream.py": textwrap.dedent("""
        from . import runtime


        class Event(object):
            def __init__(self, block=False, disable_timing=False, interprocess=False):
                self.ptr = runtime.eventCreateWithFlags(0)


        def record():  # as Stream.record makes its event: by the module's name
            return Event()
    """),
}

# Makes events on "device 1" before and after shmtensor, then sends each with device 0
# current, the driver's calls replaced by recorders; prints what happened as JSON.
PROGRAM = textwrap.dedent("""
    import importlib.util
    import inspect
    import json
    import sys

    order = sys.argv[1]
    if order == "before":
        import cupy
        cupy.cuda.runtime.current = 1
        early = cupy.cuda.Event(interprocess=True, disable_timing=True)
    import shmtensor
    from shmtensor import _reductions
    from shmtensor.cuda import _events
    from shmtensor.ipc import cuda_ipc

    assert importlib.util.find_spec("cupy") is not None  # a lookup, as is_available() does
    import cupy
    if order == "after":
        early = object.__new__(cupy.cuda.Event)  # made without the recording __init__
        early.ptr = 999
    cupy.cuda.runtime.current = 1
    late = cupy.cuda.Event(True, True, True)
    internal = cupy.cuda.stream.record()
    cupy.cuda.runtime.current = 0

    asked = []
    cuda_ipc.event_handle = lambda event, device: asked.append([event, device]) or b"h" * 64
    active = [0, 1]
    cuda_ipc.active_devices = lambda: active

    def send(ev):
        try:
            _, ctx = _reductions.dumps(ev)
            ctx.release()
            return "sent"
        except Exception as e:
            return f"{type(e).__name__}: {e}"

    init = cupy.cuda.Event.__init__
    out = {"late": getattr(late, "_shmtensor_device", None),
           "internal": getattr(internal, "_shmtensor_device", None),
           "early": getattr(early, "_shmtensor_device", None),
           "same_class": cupy.cuda.Event is cupy.cuda.stream.Event,
           "signature": str(inspect.signature(cupy.cuda.Event)),
           "wrapped_once": not hasattr(init.__wrapped__, "__wrapped__"),
           "send_late": send(late), "asked_late": list(asked)}
    del asked[:]
    out["send_early_two_gpus"] = send(early)
    out["asked_early_two_gpus"] = list(asked)
    active[:] = [1]
    out["send_early_one_gpu"] = send(early)
    out["asked_early_one_gpu"] = list(asked)
    _events.record_devices(cupy)
    out["idempotent"] = cupy.cuda.Event.__init__ is init
    out["watching"] = [type(f).__name__ for f in sys.meta_path if type(f).__name__ == "_ImportHook"]
    print(json.dumps(out))
""")


@pytest.fixture
def fake_cupy(tmp_path):
    for name, text in FAKE_CUPY.items():
        path = tmp_path / "cupy" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (tmp_path / "prog.py").write_text(PROGRAM)
    return tmp_path


@pytest.mark.parametrize("order", ["before", "after"],
                         ids=["cupy-imported-first", "shmtensor-imported-first"])
def test_events_record_their_device_and_are_sent_under_it(fake_cupy, order):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(fake_cupy)] + sys.path))
    r = subprocess.run([sys.executable, str(fake_cupy / "prog.py"), order], env=env,
                       cwd=fake_cupy, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    # made on device 1 after shmtensor: recorded, also by CuPy's own calls, with the
    # class, its signature and a single wrapper kept
    assert out["late"] == out["internal"] == 1
    assert out["same_class"] and out["idempotent"] and out["wrapped_once"]
    assert out["signature"] == "(block=False, disable_timing=False, interprocess=False)"
    assert out["watching"] == []  # the import watch left once CuPy was imported
    # sent with device 0 current: asked under device 1
    assert out["send_late"] == "sent" and out["asked_late"] == [[1001, 1]]
    # made before: not recorded; with two GPUs in use, refused before any driver call
    assert out["early"] is None
    msg = out["send_early_two_gpus"]
    assert msg.startswith("CudaIpcError: cannot send this CUDA event"), msg
    assert "several GPUs ([0, 1])" in msg and "crashes the process" in msg
    assert "Make the event after `import shmtensor`" in msg
    assert out["asked_early_two_gpus"] == []
    # with one GPU in use, it is that GPU's
    assert out["send_early_one_gpu"] == "sent"
    assert out["asked_early_one_gpu"] == [[out["asked_early_one_gpu"][0][0], 1]]


def test_a_cupy_that_is_not_cupy_is_left_alone(tmp_path):
    """A module named ``cupy`` without CuPy's Event imports as before (no error, no wrapper)."""
    (tmp_path / "cupy").mkdir()
    (tmp_path / "cupy" / "__init__.py").write_text("cuda = 3\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path)] + sys.path))
    r = subprocess.run([sys.executable, "-c", "import shmtensor, cupy; print(cupy.cuda)"],
                       env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert (r.returncode, r.stdout, r.stderr) == (0, "3\n", "")
