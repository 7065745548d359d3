import cupy as cp
e = cp.cuda.Event(interprocess=True, disable_timing=True)
print("device_id" in dir(e), [a for a in dir(e) if not a.startswith("__")])
