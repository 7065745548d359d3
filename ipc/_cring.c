/* shmtensor.ipc._cring: the hot path of ring.py in C (optional; ring.py runs without it).

   The same protocol, step for step, as ring.py's pure-Python path, on the same layout:
   a process using this module and one using the Python path share a ring.  What is here:

   - the robust mutexes' try-lock, unlock, consistent and lock-with-a-deadline, the futex
     wait and wake, and a full fence, each on an address in the ring's mapping (ring.py's
     slow paths call these in place of its ctypes calls);
   - put() and get(): the whole call when it needs no wait and no repair (the lock is free,
     there is room or a message).  Otherwise they change nothing, let go of what they took,
     and say so, and ring.py's Python code does the call (waits with deadlines, a lock
     taken over from a dead owner, a malformed record, the errors and their messages).

   put() and get() hold the GIL throughout and run no Python code except the caller's hook:
   a Python signal handler runs before or after them, never inside (only inside the hook,
   whose exception leaves the ring as it was).  The calls that block (lock_for, futex_wait)
   let go of the GIL.  Shared words are read and written with __atomic builtins: a record is
   written before the release store of the tail that publishes it and read after the
   acquire load of the tail; the head likewise; a full fence between publishing and reading
   the other side's sleeper flag (ring.py: "Waiting"). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* The layout: ring.py checks these against its own constants at import (LAYOUT). */
#define VERSION 2
#define W_LOCK 64
#define R_LOCK 128
#define TAIL 192 /* uint64; its low half is the readers' futex word */
#define HEAD 200 /* uint64; its low half is the writers' futex word */
#define R_SLEEPS 208
#define W_SLEEPS 212
#define RECORDS 320
#define REC_SIZE 16 /* uint64 sequence number, uint32 writer's index, uint32 length */
#define MAX_PROCS (1u << 16)

/* put()'s and get()'s answers when they did not do the call */
#define SLOW 0      /* nothing done, nothing held: ring.py's Python path does the call */
#define RECOVERED 2 /* the same, after taking a lock over from a dead owner (made consistent,
                       its sleeper flag cleared, let go of): ring.py counts it */

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the ring's futex words are the low halves of 64-bit counters: little-endian only"
#endif

static inline uint64_t *u64(char *base, size_t off) { return (uint64_t *)(base + off); }
static inline uint32_t *u32(char *base, size_t off) { return (uint32_t *)(base + off); }
static inline pthread_mutex_t *mutex(char *base, size_t off)
{
    return (pthread_mutex_t *)(base + off);
}

static void wake(uint64_t *word)
{
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE, 1, NULL, NULL, 0);
}

/* After publishing (tail or head), wake the other side's sleeper if it flagged itself.
   The fence orders the store before the flag's load (the sleeper sets its flag, then the
   kernel compares the word after a full barrier: one of the two sees the other). */
static void wake_if_flagged(char *base, size_t flag, size_t word)
{
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (__atomic_load_n(u32(base, flag), __ATOMIC_RELAXED))
        wake(u64(base, word));
}

/* A try-lock that takes a lock over from a dead owner on the spot: made consistent, the
   flag the dead owner may have left cleared, let go of.  Returns HELD, RECOVERED or
   SLOW (not held). */
#define HELD (-1)
static int try_take(char *base, size_t lock, size_t flag)
{
    int rc = pthread_mutex_trylock(mutex(base, lock));
    if (rc == 0)
        return HELD;
    if (rc == EOWNERDEAD) {
        pthread_mutex_consistent(mutex(base, lock));
        __atomic_store_n(u32(base, flag), 0, __ATOMIC_RELAXED);
        pthread_mutex_unlock(mutex(base, lock));
        return RECOVERED;
    }
    return SLOW; /* busy, or this thread holds it (a call inside a call) */
}

static int parse_base(PyObject *arg, char **base)
{
    *base = (char *)PyLong_AsVoidPtr(arg);
    return *base == NULL && PyErr_Occurred() ? -1 : 0;
}

/* The ring's capacity and record size as ring.py read them at attach and checked against
   the mapping's size (not the header's words again: another process could change them). */
static int parse_shape(PyObject *const *args, uint32_t *capacity, uint32_t *record_size)
{
    unsigned long c = PyLong_AsUnsignedLong(args[0]), r;
    if (c == (unsigned long)-1 && PyErr_Occurred())
        return -1;
    r = PyLong_AsUnsignedLong(args[1]);
    if (r == (unsigned long)-1 && PyErr_Occurred())
        return -1;
    if (c < 1 || c > UINT32_MAX || r < REC_SIZE || r > UINT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "a ring's capacity or record size is out of range");
        return -1;
    }
    *capacity = (uint32_t)c;
    *record_size = (uint32_t)r;
    return 0;
}

static PyObject *answer(int code) { return PyLong_FromLong(code); }

PyDoc_STRVAR(put_doc,
"put(base, capacity, record_size, index, data, hook, sent=None) -> 0, 1 or 2\n\n"
"Ring.put's fast path on the ring mapped at address base (0: closed) with the capacity\n"
"and record size that ring.py checked against its mapping, as process index index: 1\n"
"when data was written; 0 or 2 (a lock taken over from a dead owner) when\n"
"nothing was and ring.py must do the call.  hook: None or called with the record's\n"
"number under the lock; its exception propagates, nothing written.  sent: None or a\n"
"list the record's number is appended to as it is written, with no Python code between.");

static PyObject *c_put(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    char *base;
    uint32_t capacity, record_size;
    if (nargs != 6 && nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "put(base, capacity, record_size, index, data, "
                                         "hook, sent=None) takes 6 or 7 arguments");
        return NULL;
    }
    PyObject *sent = nargs == 7 ? args[6] : Py_None;
    if (sent != Py_None && !PyList_Check(sent)) {
        PyErr_SetString(PyExc_TypeError, "put(): sent must be None or a list");
        return NULL;
    }
    if (parse_base(args[0], &base) < 0 || parse_shape(args + 1, &capacity, &record_size) < 0)
        return NULL;
    unsigned long index = PyLong_AsUnsignedLong(args[3]);
    if (index == (unsigned long)-1 && PyErr_Occurred())
        return NULL;
    if (base == NULL || index >= MAX_PROCS)
        return answer(SLOW);
    PyObject *data = args[4], *hook = args[5];
    Py_buffer view;
    const char *src;
    Py_ssize_t n;
    int release = 0;
    if (PyBytes_CheckExact(data)) {
        src = PyBytes_AS_STRING(data);
        n = PyBytes_GET_SIZE(data);
    } else {
        if (PyObject_GetBuffer(data, &view, PyBUF_C_CONTIGUOUS) < 0) {
            PyErr_Clear(); /* ring.py's path says what is wrong with it */
            return answer(SLOW);
        }
        src = view.buf;
        n = view.len;
        release = 1;
    }
    int code = SLOW;
    if ((size_t)n > record_size - REC_SIZE)
        goto out; /* refused by ring.py */
    code = try_take(base, W_LOCK, W_SLEEPS);
    if (code != HELD)
        goto out;
    uint64_t t = __atomic_load_n(u64(base, TAIL), __ATOMIC_RELAXED); /* ours to write */
    /* acquire: the reader copied the record out before it let go of it */
    if (t - __atomic_load_n(u64(base, HEAD), __ATOMIC_ACQUIRE) >= capacity) {
        pthread_mutex_unlock(mutex(base, W_LOCK));
        code = SLOW; /* full: ring.py waits */
        goto out;
    }
    if (hook != Py_None) {
        PyObject *number = PyLong_FromUnsignedLongLong(t), *r = NULL;
        if (number != NULL) {
            r = PyObject_CallOneArg(hook, number);
            Py_DECREF(number);
        }
        if (r == NULL) {
            pthread_mutex_unlock(mutex(base, W_LOCK));
            if (release)
                PyBuffer_Release(&view);
            return NULL;
        }
        Py_DECREF(r);
    }
    if (sent != Py_None) { /* appended before the write, which cannot fail: one step */
        PyObject *number = PyLong_FromUnsignedLongLong(t);
        if (number == NULL || PyList_Append(sent, number) < 0) {
            Py_XDECREF(number);
            pthread_mutex_unlock(mutex(base, W_LOCK));
            if (release)
                PyBuffer_Release(&view);
            return NULL;
        }
        Py_DECREF(number);
    }
    char *rec = base + RECORDS + (size_t)(t % capacity) * record_size;
    *(uint64_t *)rec = t + 1;
    *(uint32_t *)(rec + 8) = (uint32_t)index;
    *(uint32_t *)(rec + 12) = (uint32_t)n;
    memcpy(rec + REC_SIZE, src, (size_t)n);
    __atomic_store_n(u64(base, TAIL), t + 1, __ATOMIC_RELEASE); /* publishes the record */
    pthread_mutex_unlock(mutex(base, W_LOCK));
    wake_if_flagged(base, R_SLEEPS, TAIL);
    code = 1;
out:
    if (release)
        PyBuffer_Release(&view);
    return answer(code);
}

PyDoc_STRVAR(get_doc,
"get(base, capacity, record_size, hook, into) -> bytes, 0 or 2\n\n"
"Ring.get's fast path on the ring mapped at address base (0: closed), of capacity and\n"
"record_size as put's: the message, or\n"
"0 or 2 (a lock taken over from a dead owner) when nothing was taken and ring.py must\n"
"do the call.  hook: None or called with (number, writer_index, data) under the lock\n"
"before head advances; its exception propagates, the message stays.  into: None or a\n"
"list the message is appended to before head advances, with no Python code between.");

static PyObject *c_get(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    char *base;
    uint32_t capacity, record_size;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError,
                        "get(base, capacity, record_size, hook, into) takes 5 arguments");
        return NULL;
    }
    if (parse_base(args[0], &base) < 0 || parse_shape(args + 1, &capacity, &record_size) < 0)
        return NULL;
    PyObject *hook = args[3], *into = args[4];
    if (into != Py_None && !PyList_Check(into)) {
        PyErr_SetString(PyExc_TypeError, "a ring's get(into=...) takes a list");
        return NULL;
    }
    if (base == NULL)
        return answer(SLOW);
    int code = try_take(base, R_LOCK, R_SLEEPS);
    if (code != HELD)
        return answer(code);
    uint64_t h = __atomic_load_n(u64(base, HEAD), __ATOMIC_RELAXED); /* ours to write */
    /* acquire: the writer wrote the record before the tail that published it */
    if (__atomic_load_n(u64(base, TAIL), __ATOMIC_ACQUIRE) == h) {
        pthread_mutex_unlock(mutex(base, R_LOCK));
        return answer(SLOW); /* empty: ring.py waits */
    }
    char *rec = base + RECORDS + (size_t)(h % capacity) * record_size;
    uint64_t seq = *(uint64_t *)rec;
    uint32_t k = *(uint32_t *)(rec + 8), n = *(uint32_t *)(rec + 12);
    if (seq != h + 1 || n > record_size - REC_SIZE || k >= MAX_PROCS) {
        pthread_mutex_unlock(mutex(base, R_LOCK));
        return answer(SLOW); /* malformed: ring.py steps over it and says so */
    }
    PyObject *data = PyBytes_FromStringAndSize(rec + REC_SIZE, n);
    if (data == NULL)
        goto failed;
    if (hook != Py_None) {
        PyObject *r = PyObject_CallFunction(hook, "KIO", (unsigned long long)h, k, data);
        if (r == NULL)
            goto failed;
        Py_DECREF(r);
    }
    if (into != Py_None && PyList_Append(into, data) < 0)
        goto failed;
    __atomic_store_n(u64(base, HEAD), h + 1, __ATOMIC_RELEASE); /* taken */
    pthread_mutex_unlock(mutex(base, R_LOCK));
    wake_if_flagged(base, W_SLEEPS, HEAD);
    return data;
failed: /* the message stays for the next get */
    pthread_mutex_unlock(mutex(base, R_LOCK));
    Py_XDECREF(data);
    return NULL;
}

static PyObject *address_call(PyObject *arg, int (*call)(pthread_mutex_t *))
{
    char *base;
    if (parse_base(arg, &base) < 0)
        return NULL;
    return PyLong_FromLong(call((pthread_mutex_t *)base));
}

static PyObject *c_trylock(PyObject *m, PyObject *a)
{
    return address_call(a, pthread_mutex_trylock);
}

static PyObject *c_unlock(PyObject *m, PyObject *a)
{
    return address_call(a, pthread_mutex_unlock);
}

static PyObject *c_consistent(PyObject *m, PyObject *a)
{
    return address_call(a, pthread_mutex_consistent);
}

static void deadline(clockid_t clock, double seconds, struct timespec *ts)
{
    clock_gettime(clock, ts);
    if (seconds < 0)
        seconds = 0;
    time_t whole = (time_t)seconds;
    ts->tv_sec += whole;
    ts->tv_nsec += (long)((seconds - (double)whole) * 1e9);
    if (ts->tv_nsec >= 1000000000L) {
        ts->tv_sec += 1;
        ts->tv_nsec -= 1000000000L;
    }
}

static PyObject *c_lock_for(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    char *base;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "lock_for(address, seconds) takes 2 arguments");
        return NULL;
    }
    if (parse_base(args[0], &base) < 0)
        return NULL;
    double seconds = PyFloat_AsDouble(args[1]);
    if (seconds == -1.0 && PyErr_Occurred())
        return NULL;
    struct timespec ts;
    int rc;
    Py_BEGIN_ALLOW_THREADS
#if defined(__GLIBC__) && defined(__GLIBC_PREREQ) && __GLIBC_PREREQ(2, 30)
    deadline(CLOCK_MONOTONIC, seconds, &ts);
    rc = pthread_mutex_clocklock((pthread_mutex_t *)base, CLOCK_MONOTONIC, &ts);
#else
    deadline(CLOCK_REALTIME, seconds, &ts);
    rc = pthread_mutex_timedlock((pthread_mutex_t *)base, &ts);
#endif
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}

static PyObject *c_futex_wait(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    char *addr;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError,
                        "futex_wait(address, expected, seconds) takes 3 arguments");
        return NULL;
    }
    if (parse_base(args[0], &addr) < 0)
        return NULL;
    unsigned long expected = PyLong_AsUnsignedLongMask(args[1]);
    if (expected == (unsigned long)-1 && PyErr_Occurred())
        return NULL;
    double seconds = PyFloat_AsDouble(args[2]);
    if (seconds == -1.0 && PyErr_Occurred())
        return NULL;
    if (seconds < 0)
        seconds = 0;
    struct timespec ts = {(time_t)seconds, (long)((seconds - (double)(time_t)seconds) * 1e9)};
    long rc;
    Py_BEGIN_ALLOW_THREADS
    rc = syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT, (uint32_t)expected, &ts, NULL, 0);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc < 0 ? errno : 0);
}

static PyObject *c_futex_wake(PyObject *module, PyObject *arg)
{
    char *addr;
    if (parse_base(arg, &addr) < 0)
        return NULL;
    wake((uint64_t *)addr);
    Py_RETURN_NONE;
}

static PyObject *c_fence(PyObject *module, PyObject *unused)
{
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"put", (PyCFunction)(void (*)(void))c_put, METH_FASTCALL, put_doc},
    {"get", (PyCFunction)(void (*)(void))c_get, METH_FASTCALL, get_doc},
    {"trylock", c_trylock, METH_O, "pthread_mutex_trylock(address) -> error number"},
    {"unlock", c_unlock, METH_O, "pthread_mutex_unlock(address) -> error number"},
    {"consistent", c_consistent, METH_O, "pthread_mutex_consistent(address) -> error number"},
    {"lock_for", (PyCFunction)(void (*)(void))c_lock_for, METH_FASTCALL,
     "lock_for(address, seconds) -> error number: lock with a deadline, GIL let go of"},
    {"futex_wait", (PyCFunction)(void (*)(void))c_futex_wait, METH_FASTCALL,
     "futex_wait(address, expected, seconds) -> 0 or error number, GIL let go of"},
    {"futex_wake", c_futex_wake, METH_O, "futex_wake(address): wake one sleeper"},
    {"fence", c_fence, METH_NOARGS, "a full memory barrier"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_cring",
    "The ring's hot path in C (see ipc/_cring.c); ring.py uses it when present.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__cring(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    PyObject *layout = Py_BuildValue("(iiiiiiiiIi)", W_LOCK, R_LOCK, TAIL, HEAD, R_SLEEPS,
                                     W_SLEEPS, RECORDS, REC_SIZE, MAX_PROCS, VERSION);
    if (PyModule_AddObject(m, "LAYOUT", layout) < 0) {
        Py_XDECREF(layout);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
