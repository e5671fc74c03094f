/* kvstore's data-plane hot loops, native: frames off a socket, block bytes received straight into
 * their extents with each block's xxh3-64 computed in the same pass, and scatter-gather sends.
 *
 * Small and at the bottom on purpose (see transfer/native.py, the only caller): it moves and
 * checks bytes; every decision (grants, leases, auth, commits) stays in Python. Everything it
 * reads from the network is a length or block bytes, and no length is trusted: a frame's length
 * is checked against the caller's limit before a byte of it is allocated, and block bytes only
 * ever land in the buffers the caller gives (exactly their size) or in a fixed scratch buffer.
 *
 * The GIL is released for every system call and every hash. Sockets are blocking with kernel
 * timeouts (SO_RCVTIMEO/SO_SNDTIMEO, see transfer.wire.set_timeouts): a wait that runs out fails
 * with EAGAIN, raised as BlockingIOError as Python's own socket methods do.
 *
 * xxh3 comes from the xxhash package kvstore depends on already: its extension module exports
 * the XXH3 functions, which this module looks up once at import (nothing vendored, nothing
 * downloaded). Where they are not exported the import fails and transfer.native falls back. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>

#define MAX_IOV 1024
#define SCRATCH_BYTES (64 * 1024)

typedef struct XXH3_state_s XXH3_state_t;
static uint64_t (*xxh3_oneshot)(const void *, size_t);
static XXH3_state_t *(*xxh3_create)(void);
static int (*xxh3_free)(XXH3_state_t *);
static int (*xxh3_reset)(XXH3_state_t *);
static int (*xxh3_update)(XXH3_state_t *, const void *, size_t);
static uint64_t (*xxh3_digest)(const XXH3_state_t *);

/* -- receiving ------------------------------------------------------------------------------ */

/* One recvmsg into iov[0..n), the GIL released; retried on EINTR after Python's signal handlers
 * ran. Returns the bytes received (0 at EOF) or -1 with a Python exception set. */
static Py_ssize_t recv_iov(int fd, struct iovec *iov, int n) {
    for (;;) {
        struct msghdr msg;
        memset(&msg, 0, sizeof msg);
        msg.msg_iov = iov;
        msg.msg_iovlen = (size_t)n;
        ssize_t got;
        int err;
        Py_BEGIN_ALLOW_THREADS
        got = recvmsg(fd, &msg, 0);
        err = errno;
        Py_END_ALLOW_THREADS
        if (got >= 0)
            return (Py_ssize_t)got;
        if (err == EINTR) {
            if (PyErr_CheckSignals() < 0)
                return -1;
            continue;
        }
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
}

/* Fill buf[0..n) exactly. ``idle_ok``: EAGAIN before the first byte returns 0 (nothing came) and
 * EOF before the first byte raises EOFError("peer closed the connection"); otherwise both are
 * errors mid-message. Returns 1 when filled, 0 for "nothing came", -1 with an exception set. */
static int recv_exact(int fd, char *buf, size_t n, int idle_ok) {
    size_t got = 0;
    while (got < n) {
        struct iovec iov = {buf + got, n - got};
        Py_ssize_t k = recv_iov(fd, &iov, 1);
        if (k < 0) {
            if (idle_ok && got == 0 && PyErr_ExceptionMatches(PyExc_BlockingIOError)) {
                PyErr_Clear();
                return 0;
            }
            return -1;
        }
        if (k == 0) {
            PyErr_SetString(PyExc_EOFError, idle_ok && got == 0 ? "peer closed the connection"
                                                                 : "peer closed the connection mid-message");
            return -1;
        }
        got += (size_t)k;
    }
    return 1;
}

PyDoc_STRVAR(recv_frame_doc,
"recv_frame(fd, max_frame, eager) -> bytes | int | None\n\n"
"The next frame off blocking socket ``fd``: its payload when it is at most ``eager`` bytes;\n"
"its length (the header consumed, not a byte of the payload) when it is longer, for the caller\n"
"to count and read; None when no byte arrived within the socket's timeout. A length over\n"
"``max_frame`` raises ValueError before anything is allocated; EOF raises EOFError; a frame\n"
"that stalls halfway raises BlockingIOError.");

static PyObject *recv_frame(PyObject *self, PyObject *args) {
    int fd;
    long long max_frame, eager;
    if (!PyArg_ParseTuple(args, "iLL:recv_frame", &fd, &max_frame, &eager))
        return NULL;
    unsigned char header[4];
    int r = recv_exact(fd, (char *)header, sizeof header, 1);
    if (r < 0)
        return NULL;
    if (r == 0)
        Py_RETURN_NONE;
    uint32_t length = ((uint32_t)header[0] << 24) | ((uint32_t)header[1] << 16) | ((uint32_t)header[2] << 8) |
                      (uint32_t)header[3];
    if ((long long)length > max_frame)
        return PyErr_Format(PyExc_ValueError, "frame of %lu bytes exceeds the limit of %lld", (unsigned long)length,
                            max_frame);
    if ((long long)length > eager)
        return PyLong_FromUnsignedLong(length);
    PyObject *payload = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)length);
    if (payload == NULL)
        return NULL;
    /* Not yet shared with anyone: written with the GIL released (inside recv_iov). */
    if (length && recv_exact(fd, PyBytes_AS_STRING(payload), length, 0) < 0) {
        Py_DECREF(payload);
        return NULL;
    }
    return payload;
}

typedef struct {
    char *buf;
    int is_buf;      /* 0: a run of bytes to drop */
    size_t len;
    size_t filled;
    int streaming;   /* its hash state took a first chunk: it goes on streaming */
    uint64_t sum;
} part_t;

/* Hash what part ``p`` received since ``before`` (the GIL held or not: pure C on owned memory). */
static void hash_progress(part_t *p, size_t before, XXH3_state_t *state) {
    if (!p->is_buf || p->filled == before)
        return;
    if (!p->streaming && before == 0 && p->filled == p->len) {
        p->sum = xxh3_oneshot(p->buf, p->len); /* arrived whole in one receive: one pass */
        return;
    }
    if (!p->streaming) {
        xxh3_reset(state);
        p->streaming = 1;
    }
    xxh3_update(state, p->buf + before, p->filled - before); /* still in cache: just received */
    if (p->filled == p->len)
        p->sum = xxh3_digest(state);
}

PyDoc_STRVAR(recv_parts_doc,
"recv_parts(fd, parts, hash) -> list[int | None] | None\n\n"
"Receive, in order, into each writable buffer of ``parts`` (exactly its size) and drop the\n"
"number of bytes each int says. Buffers in a row go in one scatter receive. With ``hash``, the\n"
"xxh3-64 of each buffer, computed as its bytes land, in a list aligned with ``parts`` (None for\n"
"dropped runs); without, None. EOF raises EOFError, a stall BlockingIOError.");

static PyObject *recv_parts(PyObject *self, PyObject *args) {
    int fd, want_hash;
    PyObject *seq_in;
    if (!PyArg_ParseTuple(args, "iOp:recv_parts", &fd, &seq_in, &want_hash))
        return NULL;
    /* A tuple of the parts: nothing a buffer export runs can change what this call walks. */
    PyObject *seq = PySequence_Tuple(seq_in);
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(seq);
    part_t *parts = PyMem_Calloc((size_t)(n ? n : 1), sizeof(part_t));
    Py_buffer *views = PyMem_Calloc((size_t)(n ? n : 1), sizeof(Py_buffer));
    char *scratch = NULL;
    XXH3_state_t *state = NULL;
    PyObject *result = NULL;
    struct iovec iov[MAX_IOV];
    if (parts == NULL || views == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyTuple_GET_ITEM(seq, i);
        if (PyLong_Check(item)) {
            /* A run to drop: its length came from the network. One no stream can carry is refused. */
            unsigned long long drop = PyLong_AsUnsignedLongLong(item);
            if (PyErr_Occurred() || drop > (unsigned long long)PY_SSIZE_T_MAX) {
                PyErr_Clear();
                PyErr_Format(PyExc_ValueError, "recv_parts: part %zd drops %R bytes", i, item);
                goto done_release;
            }
            parts[i].len = (size_t)drop;
            continue;
        }
        if (PyObject_GetBuffer(item, &views[i], PyBUF_WRITABLE) < 0) {
            /* An empty read-only view receives nothing: taken as it is. */
            if (!PyErr_ExceptionMatches(PyExc_BufferError) || PyObject_GetBuffer(item, &views[i], PyBUF_SIMPLE) < 0)
                goto done_release;
            PyErr_Clear();
            if (views[i].len != 0) {
                PyBuffer_Release(&views[i]);
                PyErr_Format(PyExc_BufferError, "recv_parts: part %zd is not writable", i);
                goto done_release;
            }
        }
        parts[i].is_buf = 1;
        parts[i].buf = views[i].buf;
        parts[i].len = (size_t)views[i].len;
    }
    if (want_hash && (state = xxh3_create()) == NULL) {
        PyErr_NoMemory();
        goto done_release;
    }
    Py_ssize_t at = 0;
    while (at < n) {
        part_t *p = &parts[at];
        if (p->filled == p->len) {
            at++;
            continue;
        }
        if (!p->is_buf) { /* a run to drop: through a fixed scratch buffer, never one of its size */
            if (scratch == NULL && (scratch = PyMem_Malloc(SCRATCH_BYTES)) == NULL) {
                PyErr_NoMemory();
                goto done_release;
            }
            size_t want = p->len - p->filled;
            struct iovec one = {scratch, want < SCRATCH_BYTES ? want : SCRATCH_BYTES};
            Py_ssize_t k = recv_iov(fd, &one, 1);
            if (k < 0)
                goto done_release;
            if (k == 0) {
                PyErr_SetString(PyExc_EOFError, "peer closed the connection mid-message");
                goto done_release;
            }
            p->filled += (size_t)k;
            continue;
        }
        /* The buffers from here up to the next drop (or MAX_IOV of them) in one scatter receive. */
        int m = 0;
        for (Py_ssize_t j = at; j < n && m < MAX_IOV && parts[j].is_buf; j++) {
            if (parts[j].filled == parts[j].len)
                continue;
            iov[m].iov_base = parts[j].buf + parts[j].filled;
            iov[m].iov_len = parts[j].len - parts[j].filled;
            m++;
        }
        Py_ssize_t k = recv_iov(fd, iov, m);
        if (k < 0)
            goto done_release;
        if (k == 0) {
            PyErr_SetString(PyExc_EOFError, "peer closed the connection mid-message");
            goto done_release;
        }
        /* Account for the bytes in order, hashing each buffer's new bytes while they are in cache
         * (the GIL let go only for a long hash: a short one costs less than the switch). */
        size_t left = (size_t)k;
        PyThreadState *ts = want_hash && left >= SCRATCH_BYTES ? PyEval_SaveThread() : NULL;
        for (Py_ssize_t j = at; j < n && left && parts[j].is_buf; j++) {
            part_t *q = &parts[j];
            size_t room = q->len - q->filled, take = left < room ? left : room;
            size_t before = q->filled;
            q->filled += take;
            left -= take;
            if (want_hash)
                hash_progress(q, before, state);
        }
        if (ts != NULL)
            PyEval_RestoreThread(ts);
    }
    if (!want_hash) {
        Py_INCREF(Py_None);
        result = Py_None;
        goto done_release;
    }
    result = PyList_New(n);
    if (result == NULL)
        goto done_release;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v;
        if (!parts[i].is_buf) {
            Py_INCREF(Py_None);
            v = Py_None;
        } else {
            if (parts[i].len == 0)
                parts[i].sum = xxh3_oneshot(parts[i].buf, 0);
            v = PyLong_FromUnsignedLongLong(parts[i].sum);
            if (v == NULL) {
                Py_CLEAR(result);
                goto done_release;
            }
        }
        PyList_SET_ITEM(result, i, v);
    }
done_release:
    for (Py_ssize_t i = 0; i < n; i++)
        if (parts[i].is_buf)
            PyBuffer_Release(&views[i]);
done:
    if (state != NULL)
        xxh3_free(state);
    PyMem_Free(scratch);
    PyMem_Free(parts);
    PyMem_Free(views);
    Py_DECREF(seq);
    return result;
}

/* -- sending -------------------------------------------------------------------------------- */

PyDoc_STRVAR(send_buffers_doc,
"send_buffers(fd, buffers) -> None\n\n"
"Send every buffer of ``buffers``, in order, with scatter-gather (MSG_NOSIGNAL) and no copies,\n"
"until all are out. A send that cannot go on within the socket's timeout raises BlockingIOError.");

static PyObject *send_buffers(PyObject *self, PyObject *args) {
    int fd;
    PyObject *seq_in;
    if (!PyArg_ParseTuple(args, "iO:send_buffers", &fd, &seq_in))
        return NULL;
    PyObject *seq = PySequence_Tuple(seq_in); /* fixed while buffers are exported (see recv_parts) */
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(seq);
    Py_buffer *views = PyMem_Calloc((size_t)(n ? n : 1), sizeof(Py_buffer));
    struct iovec *iov = PyMem_Calloc((size_t)(n ? n : 1), sizeof(struct iovec));
    PyObject *result = NULL;
    Py_ssize_t held = 0;
    if (views == NULL || iov == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; held < n; held++) {
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(seq, held), &views[held], PyBUF_SIMPLE) < 0)
            goto done;
        iov[held].iov_base = views[held].buf;
        iov[held].iov_len = (size_t)views[held].len;
    }
    Py_ssize_t at = 0;
    while (at < n) {
        if (iov[at].iov_len == 0) {
            at++;
            continue;
        }
        struct msghdr msg;
        memset(&msg, 0, sizeof msg);
        msg.msg_iov = &iov[at];
        msg.msg_iovlen = (size_t)(n - at < MAX_IOV ? n - at : MAX_IOV);
        ssize_t sent;
        int err;
        Py_BEGIN_ALLOW_THREADS
        sent = sendmsg(fd, &msg, MSG_NOSIGNAL);
        err = errno;
        Py_END_ALLOW_THREADS
        if (sent < 0) {
            if (err == EINTR) {
                if (PyErr_CheckSignals() < 0)
                    goto done;
                continue;
            }
            errno = err;
            PyErr_SetFromErrno(PyExc_OSError);
            goto done;
        }
        size_t left = (size_t)sent;
        while (left && at < n) {
            if (left >= iov[at].iov_len) {
                left -= iov[at].iov_len;
                iov[at].iov_len = 0;
                at++;
            } else {
                iov[at].iov_base = (char *)iov[at].iov_base + left;
                iov[at].iov_len -= left;
                left = 0;
            }
        }
    }
    Py_INCREF(Py_None);
    result = Py_None;
done:
    for (Py_ssize_t i = 0; i < held; i++)
        PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    PyMem_Free(iov);
    Py_DECREF(seq);
    return result;
}

static PyMethodDef methods[] = {
    {"recv_frame", recv_frame, METH_VARARGS, recv_frame_doc},
    {"recv_parts", recv_parts, METH_VARARGS, recv_parts_doc},
    {"send_buffers", send_buffers, METH_VARARGS, send_buffers_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "transfer._native", NULL, -1, methods};

/* The XXH3 functions of the xxhash package's extension (loaded by Python already). */
static int find_xxh3(void) {
    PyObject *mod = PyImport_ImportModule("xxhash._xxhash");
    if (mod == NULL)
        return -1;
    PyObject *file = PyObject_GetAttrString(mod, "__file__");
    Py_DECREF(mod);
    if (file == NULL)
        return -1;
    const char *path = PyUnicode_AsUTF8(file);
    if (path == NULL) {
        Py_DECREF(file);
        return -1;
    }
    void *lib = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    if (lib == NULL)
        lib = dlopen(path, RTLD_NOW);
    if (lib == NULL) {
        PyErr_Format(PyExc_ImportError, "cannot open %s: %s", path, dlerror());
        Py_DECREF(file);
        return -1;
    }
    Py_DECREF(file);
    *(void **)&xxh3_oneshot = dlsym(lib, "XXH3_64bits");
    *(void **)&xxh3_create = dlsym(lib, "XXH3_createState");
    *(void **)&xxh3_free = dlsym(lib, "XXH3_freeState");
    *(void **)&xxh3_reset = dlsym(lib, "XXH3_64bits_reset");
    *(void **)&xxh3_update = dlsym(lib, "XXH3_64bits_update");
    *(void **)&xxh3_digest = dlsym(lib, "XXH3_64bits_digest");
    if (!xxh3_oneshot || !xxh3_create || !xxh3_free || !xxh3_reset || !xxh3_update || !xxh3_digest) {
        PyErr_SetString(PyExc_ImportError, "the xxhash package's library does not export the XXH3-64 functions");
        return -1; /* the handle stays: the library is Python's, loaded for good */
    }
    return 0;
}

PyMODINIT_FUNC PyInit__native(void) {
    if (find_xxh3() < 0)
        return NULL;
    return PyModule_Create(&module);
}
