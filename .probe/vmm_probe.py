import os, sys, time, socket, array, multiprocessing as mp
sys.path.insert(0, os.getcwd())
import cupy as cp
from ipc import cuda_vmm as v
from cuda.bindings import driver as d
A = d.CUdevice_attribute
print("attrs", A.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED.value, A.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED.value)
print("enums", d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE.value, d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED.value,
      d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR.value, d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE.value,
      d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED.value)
import ctypes
print("sizeof prop", ctypes.sizeof(v._AllocationProp))

def sendfd(sock, fd): sock.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
def recvfd(sock):
    msg, anc, _, _ = sock.recvmsg(1, socket.CMSG_LEN(4)); return array.array("i", anc[0][2][:4])[0]

def child_producer(sock):
    import cupy as cp
    from ipc import cuda_vmm as v
    cp.zeros(1)
    g = v.granularity(0)
    h = v.create(0, g); ptr = v.map_handle(0, h, g)
    a = cp.ndarray((g // 8,), cp.float64, cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(ptr, g, None, 0), 0))
    a[:] = 7; cp.cuda.runtime.deviceSynchronize()
    fd = v.export_fd(0, h)
    v.release(0, h)
    sendfd(sock, fd); os.close(fd)
    v.unmap(0, ptr, g)
    os._exit(0)   # exits with the fd still in flight

if __name__ == "__main__":
    cp.zeros(1)
    print("supported", v.supported(0))
    g = v.granularity(0); print("granularity", g)
    t = time.perf_counter(); h = v.create(0, g); t1 = time.perf_counter()
    ptr = v.map_handle(0, h, g); t2 = time.perf_counter()
    fd = v.export_fd(0, h); t3 = time.perf_counter()
    print(f"create {1e6*(t1-t):.0f}us map {1e6*(t2-t1):.0f}us export {1e6*(t3-t2):.0f}us")
    t = time.perf_counter(); h2 = v.import_fd(0, fd); t1 = time.perf_counter()
    ptr2 = v.map_handle(0, h2, g); t2 = time.perf_counter()
    print(f"self import {1e6*(t1-t):.0f}us map {1e6*(t2-t1):.0f}us same handle? {h==h2}")
    try:
        fd2 = v.export_fd(0, h2); print("re-export of imported handle OK", fd2); os.close(fd2)
    except Exception as e: print("re-export of imported handle FAILED", e)
    v.unmap(0, ptr2, g); v.release(0, h2); v.unmap(0, ptr, g); v.release(0, h); os.close(fd)
    # producer exits with fd in flight
    ctx = mp.get_context("spawn")
    a, b = socket.socketpair()
    p = ctx.Process(target=child_producer, args=(a,)); p.start(); p.join(); print("producer exit", p.exitcode)
    fd = recvfd(b)
    t = time.perf_counter(); h = v.import_fd(0, fd); ptr = v.map_handle(0, h, g); t1 = time.perf_counter()
    os.close(fd); v.release(0, h)
    x = cp.ndarray((g // 8,), cp.float64, cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(ptr, g, None, 0), 0))
    print(f"import+map after producer exit {1e6*(t1-t):.0f}us, sum ok: {float(x.sum()) == 7.0 * (g // 8)}")
    # timing: small ops
    import ctypes
    t = time.perf_counter()
    for _ in range(1000):
        e = cp.cuda.Event(block=False, disable_timing=True); e.record()
    print(f"event create+record {1e3*(time.perf_counter()-t):.1f}us")
    ev = cp.cuda.Event(block=False, disable_timing=True, interprocess=True)
    t = time.perf_counter()
    for _ in range(1000):
        ev.record()
    print(f"ipc event record {1e3*(time.perf_counter()-t):.1f}us")
    t = time.perf_counter()
    for _ in range(1000):
        cp.cuda.runtime.streamWaitEvent(cp.cuda.get_current_stream().ptr, ev.ptr)
    print(f"streamWaitEvent {1e3*(time.perf_counter()-t):.1f}us")
    t = time.perf_counter()
    for _ in range(1000):
        m = cp.cuda.UnownedMemory(ptr, 64, None, 0); y = cp.ndarray((5,), cp.int64, cp.cuda.MemoryPointer(m, 128))
    print(f"ndarray on unowned {1e3*(time.perf_counter()-t):.1f}us")
    t = time.perf_counter()
    for _ in range(1000):
        z = y.copy()
    print(f"copy 5 int64 {1e3*(time.perf_counter()-t):.1f}us")
    s = cp.zeros(5, cp.int64)
    t = time.perf_counter()
    for _ in range(1000):
        s += y
    print(f"s += y {1e3*(time.perf_counter()-t):.1f}us")
    v.unmap(0, ptr, g)
    print("done")
