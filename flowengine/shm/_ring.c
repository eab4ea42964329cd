/* The per-record fast paths of the shared-memory rings, in C.
 *
 * flowengine.shm.writer.RingWriter and flowengine.shm.reader.RingReader subclass the
 * two types here. A Python send or receive costs 0.5-1 us in attribute loads and
 * bytecode (measured in docs/benchmarks-ring.md); here a record costs one call, a
 * memcpy and a few stores. Only the common case lives in C: a record that fits
 * before the end of the buffer and before the slowest reader (writer), or a record
 * that is already published (reader). Everything else -- wrap markers on the writer
 * side, waiting, doorbells, reaping dead readers, publishing the read cursor --
 * stays in Python and is called from here by method name (`_try_send_slow`,
 * `_send_waiting`, `_wake_readers`, `_publish`, `_detached`, `_recv_waiting`).
 *
 * Record format and cursors: see record.py and segment.py. A record is an int64
 * payload length followed by the payload, padded to a multiple of 8 bytes; a length
 * of -1 is a wrap marker (the next record starts the next lap). Cursors are byte
 * counts since creation; a record lives at data_offset + cursor % capacity.
 *
 * Memory ordering (C11 atomics, so the compiler cannot reorder either; on x86-64
 * they compile to plain moves): the writer copies the record, then stores the write
 * cursor with release semantics; the reader loads the write cursor with acquire
 * semantics, then copies. A reader that sees the cursor therefore sees the whole
 * record. After its copies the reader issues an acquire fence and loads its attach
 * token: if the writer overwrote a record during the copy, the reader was marked
 * dead first (segment.mark_reader_dead clears the token), so the copy is discarded.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>

#define HEADER_BYTES 8
#define WRAP (-1) /* length word of a wrap marker */

static inline long long record_bytes(long long n) { return (n + 15) & -8LL; }

static inline int64_t load_acquire(const int64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static inline int64_t load_relaxed(const int64_t *p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
static inline void store_release(int64_t *p, int64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

/* Map the buffer protocol onto a pointer to one header word, checking bounds. */
static int64_t *word_ptr(Py_buffer *view, Py_ssize_t word)
{
    if (word < 0 || word >= view->len / 8) {
        PyErr_Format(PyExc_ValueError, "header word %zd outside the %zd-byte mapping", word,
                     view->len);
        return NULL;
    }
    return (int64_t *)((char *)view->buf + word * 8);
}

/* Call self.<name>(*args) and return its result (a new reference, or NULL). */
static PyObject *call_method(PyObject *self, const char *name, PyObject *const *args,
                             size_t nargs)
{
    PyObject *meth_name = PyUnicode_InternFromString(name);
    if (meth_name == NULL)
        return NULL;
    PyObject *stack[4];
    stack[0] = self;
    for (size_t i = 0; i < nargs && i < 3; i++)
        stack[i + 1] = args[i];
    PyObject *result = PyObject_VectorcallMethod(
        meth_name, stack, (nargs + 1) | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    Py_DECREF(meth_name);
    return result;
}

/* Parse (data, timeout_s=None) or (timeout_s=None) from a vectorcall. */
static int parse_timeout(const char *fname, PyObject *const *args, Py_ssize_t nargs,
                         PyObject *kwnames, Py_ssize_t npos, PyObject **timeout)
{
    *timeout = Py_None;
    Py_ssize_t nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    if (nargs < npos || nargs + nkw > npos + 1) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd positional argument%s and an optional "
                     "timeout_s", fname, npos, npos == 1 ? "" : "s");
        return -1;
    }
    if (nargs == npos + 1)
        *timeout = args[npos];
    if (nkw == 1)
        *timeout = args[nargs];
    if (nkw == 1) {
        if (!PyUnicode_Check(PyTuple_GET_ITEM(kwnames, 0)) ||
            PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, 0), "timeout_s") != 0) {
            PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument %R", fname,
                         PyTuple_GET_ITEM(kwnames, 0));
            return -1;
        }
    }
    if (*timeout != Py_None && !PyFloat_Check(*timeout) && !PyLong_Check(*timeout)) {
        PyErr_Format(PyExc_TypeError, "%s(): timeout_s must be a number of seconds or None, "
                     "not %.100s", fname, Py_TYPE(*timeout)->tp_name);
        return -1;
    }
    return 0;
}

/* flowengine.shm.errors.<name>, imported on first use and kept. */
static PyObject *shm_error(const char *name, PyObject **cache)
{
    if (*cache == NULL) {
        PyObject *mod = PyImport_ImportModule("flowengine.shm.errors");
        if (mod == NULL)
            return NULL;
        *cache = PyObject_GetAttrString(mod, name);
        Py_DECREF(mod);
    }
    return *cache;
}

static PyObject *closed_error, *ring_error;

static int raise_closed(PyObject *self, const char *end)
{
    PyObject *type = shm_error("ChannelClosedError", &closed_error);
    if (type == NULL)
        return -1;
    PyObject *name = PyObject_GetAttrString(self, "name");
    if (name == NULL) { /* a bare core that was never set up */
        PyErr_Clear();
        PyErr_Format(type, "ring %s is closed (or was never attached)", end);
        return -1;
    }
    PyErr_Format(type, "ring %S: %s closed", name, end);
    Py_DECREF(name);
    return -1;
}

/* ------------------------------------------------------------------------------ */
/* Writer                                                                          */

typedef struct {
    PyObject_HEAD
    Py_buffer view;          /* the mapping; view.obj == NULL while unbound */
    char *mem;               /* view.buf */
    int64_t *write_cursor;   /* header word WRITE_CURSOR_W */
    int64_t *readers_asleep; /* header word READERS_ASLEEP_W */
    long long w;             /* write cursor (bytes since creation) */
    long long base;          /* w + base = byte offset of cursor w's record in this lap */
    long long fast_end;      /* records ending at or before this need no Python */
} WriterCore;

static void writer_unbind_view(WriterCore *self)
{
    if (self->view.obj != NULL)
        PyBuffer_Release(&self->view);
    self->mem = NULL;
    self->write_cursor = self->readers_asleep = NULL;
}

static void writer_dealloc(WriterCore *self)
{
    writer_unbind_view(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *writer_bind(WriterCore *self, PyObject *args)
{
    PyObject *buffer;
    Py_ssize_t cursor_word, asleep_word;
    if (!PyArg_ParseTuple(args, "Onn:_bind", &buffer, &cursor_word, &asleep_word))
        return NULL;
    writer_unbind_view(self);
    if (PyObject_GetBuffer(buffer, &self->view, PyBUF_WRITABLE) < 0)
        return NULL;
    self->write_cursor = word_ptr(&self->view, cursor_word);
    self->readers_asleep = word_ptr(&self->view, asleep_word);
    if (self->write_cursor == NULL || self->readers_asleep == NULL) {
        writer_unbind_view(self);
        return NULL;
    }
    self->mem = self->view.buf;
    Py_RETURN_NONE;
}

static PyObject *writer_unbind(WriterCore *self, PyObject *Py_UNUSED(ignored))
{
    writer_unbind_view(self);
    Py_RETURN_NONE;
}

/* Append `data` if it fits on the fast path. Returns 1 if sent, 0 if the record needs
 * the slow path (its length in *n_out), -1 with an exception set. */
static int writer_fast_send(WriterCore *self, PyObject *data, Py_ssize_t *n_out)
{
    Py_buffer src;
    if (PyObject_GetBuffer(data, &src, PyBUF_SIMPLE) < 0)
        return -1;
    Py_ssize_t n = src.len;
    *n_out = n;
    if (self->mem == NULL) {
        PyBuffer_Release(&src);
        return raise_closed((PyObject *)self, "writer");
    }
    long long end = self->w + record_bytes(n);
    if (end > self->fast_end) {
        PyBuffer_Release(&src);
        return 0;
    }
    long long off = self->w + self->base; /* the record's byte offset in the mapping */
    if (off < 0 || end - self->w > self->view.len - off) {
        /* Only if Python code set _w/_base/_fast_end wrongly: never write outside. */
        PyBuffer_Release(&src);
        PyErr_SetString(PyExc_RuntimeError, "ring writer state is corrupt");
        return -1;
    }
    char *rec = self->mem + off;
    *(int64_t *)rec = n;
    memcpy(rec + HEADER_BYTES, src.buf, (size_t)n);
    PyBuffer_Release(&src);
    store_release(self->write_cursor, end); /* publication: after the copy */
    self->w = end;
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (load_relaxed(self->readers_asleep)) {
        PyObject *r = call_method((PyObject *)self, "_wake_readers", NULL, 0);
        if (r == NULL)
            return -1;
        Py_DECREF(r);
    }
    return 1;
}

static PyObject *writer_try_send(WriterCore *self, PyObject *data)
{
    Py_ssize_t n;
    int sent = writer_fast_send(self, data, &n);
    if (sent < 0)
        return NULL;
    if (sent)
        Py_RETURN_TRUE;
    PyObject *n_obj = PyLong_FromSsize_t(n);
    if (n_obj == NULL)
        return NULL;
    PyObject *args[2] = {data, n_obj};
    PyObject *result = call_method((PyObject *)self, "_try_send_slow", args, 2);
    Py_DECREF(n_obj);
    return result;
}

static PyObject *writer_send(WriterCore *self, PyObject *const *args, Py_ssize_t nargs,
                             PyObject *kwnames)
{
    PyObject *timeout;
    if (parse_timeout("send", args, nargs, kwnames, 1, &timeout) < 0)
        return NULL;
    PyObject *data = args[0];
    PyObject *sent_obj = writer_try_send(self, data);
    if (sent_obj == NULL)
        return NULL;
    int sent = PyObject_IsTrue(sent_obj);
    Py_DECREF(sent_obj);
    if (sent < 0)
        return NULL;
    if (sent)
        Py_RETURN_NONE;
    PyObject *wait_args[2] = {data, timeout};
    return call_method((PyObject *)self, "_send_waiting", wait_args, 2);
}

static PyMethodDef writer_methods[] = {
    {"_bind", (PyCFunction)writer_bind, METH_VARARGS,
     "_bind(buffer, write_cursor_word, readers_asleep_word): map the ring's writable "
     "buffer (the segment's mmap); the words are int64 indices into it."},
    {"_unbind", (PyCFunction)writer_unbind, METH_NOARGS,
     "Release the buffer; later sends raise ChannelClosedError."},
    {"try_send", (PyCFunction)writer_try_send, METH_O,
     "try_send(data) -> bool: append one record if there is room now, else False.\n\n"
     "data: any contiguous bytes-like object (its bytes are the payload).\n"
     "Raises RecordTooLargeError if it can never fit, ChannelClosedError after close()."},
    {"send", (PyCFunction)(void (*)(void))writer_send, METH_FASTCALL | METH_KEYWORDS,
     "send(data, timeout_s=None): append one record, waiting while the ring is full "
     "(backpressure: nothing dropped).\n\nSpins for SPIN_NS, then sleeps on the writer "
     "doorbell until a reader frees room.\nRaises RecordTooLargeError (can never fit), "
     "TimeoutError (no room within timeout_s seconds; None waits forever)."},
    {NULL}};

static PyMemberDef writer_members[] = {
    {"_w", T_LONGLONG, offsetof(WriterCore, w), 0, "write cursor, bytes since creation"},
    {"_base", T_LONGLONG, offsetof(WriterCore, base), 0,
     "added to a cursor of the current lap, gives its byte offset in the mapping"},
    {"_fast_end", T_LONGLONG, offsetof(WriterCore, fast_end), 0,
     "min(end of the lap, room the readers leave): the fast path's bound"},
    {NULL}};

static PyTypeObject WriterCoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "flowengine.shm._ring.WriterCore",
    .tp_basicsize = sizeof(WriterCore),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "The per-record fast path of a ring writer (base class of RingWriter).",
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)writer_dealloc,
    .tp_methods = writer_methods,
    .tp_members = writer_members,
};

/* ------------------------------------------------------------------------------ */
/* Reader                                                                          */

typedef struct {
    PyObject_HEAD
    Py_buffer view;
    const char *mem;
    int64_t *write_cursor;
    int64_t *token_word;     /* this reader slot's attach token */
    int64_t *read_cursor;    /* this reader slot's cursor, as the writer sees it */
    int64_t *writer_asleep;  /* header word WRITER_ASLEEP_W */
    long long data_off, cap;
    long long max_batch_bytes;
    long long r;             /* read cursor */
    long long cached_w;      /* last write cursor seen; reloaded only when caught up */
    long long published;     /* read cursor last stored for the writer */
    long long publish_bytes; /* publish after this many bytes of records */
    long long token;
} ReaderCore;

static void reader_unbind_view(ReaderCore *self)
{
    if (self->view.obj != NULL)
        PyBuffer_Release(&self->view);
    self->mem = NULL;
    self->write_cursor = self->token_word = self->read_cursor = self->writer_asleep = NULL;
}

static void reader_dealloc(ReaderCore *self)
{
    reader_unbind_view(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *reader_bind(ReaderCore *self, PyObject *args)
{
    PyObject *buffer;
    Py_ssize_t cursor_word, token_word, read_cursor_word, asleep_word;
    long long data_off, cap, max_batch;
    if (!PyArg_ParseTuple(args, "OnnnnLLL:_bind", &buffer, &cursor_word, &token_word,
                          &read_cursor_word, &asleep_word, &data_off, &cap, &max_batch))
        return NULL;
    reader_unbind_view(self);
    if (PyObject_GetBuffer(buffer, &self->view, PyBUF_WRITABLE) < 0)
        return NULL;
    self->write_cursor = word_ptr(&self->view, cursor_word);
    self->token_word = word_ptr(&self->view, token_word);
    self->read_cursor = self->token_word == NULL ? NULL : word_ptr(&self->view, read_cursor_word);
    self->writer_asleep = self->read_cursor == NULL ? NULL : word_ptr(&self->view, asleep_word);
    if (self->write_cursor == NULL || self->writer_asleep == NULL) {
        reader_unbind_view(self);
        return NULL;
    }
    if (cap <= 0 || data_off < 0 || data_off > self->view.len || cap > self->view.len - data_off ||
        data_off % 8 || cap % 8 || max_batch <= 0) {
        reader_unbind_view(self);
        PyErr_SetString(PyExc_ValueError, "bad ring geometry");
        return NULL;
    }
    self->mem = self->view.buf;
    self->data_off = data_off;
    self->cap = cap;
    self->max_batch_bytes = max_batch;
    Py_RETURN_NONE;
}

static PyObject *reader_unbind(ReaderCore *self, PyObject *Py_UNUSED(ignored))
{
    reader_unbind_view(self);
    Py_RETURN_NONE;
}

/* Raise self._detached() if our slot's token changed (call after the copies). */
static int reader_check_token(ReaderCore *self)
{
    __atomic_thread_fence(__ATOMIC_ACQUIRE); /* the copies' loads complete first */
    if (load_relaxed(self->token_word) == self->token)
        return 0;
    PyObject *exc = call_method((PyObject *)self, "_detached", NULL, 0);
    if (exc != NULL) {
        PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
        Py_DECREF(exc);
    }
    return -1;
}

/* A length word that no record at this position can have: the writer overwrote it
 * under a detached reader (ReaderDetachedError), or the segment is corrupt (RingError).
 * Checked before the copy, so a bad length never makes us read past the lap's end. */
static int reader_bad_length(ReaderCore *self, int64_t n, long long r)
{
    if (reader_check_token(self) < 0)
        return -1;
    PyObject *type = shm_error("RingError", &ring_error);
    PyObject *name = type == NULL ? NULL : PyObject_GetAttrString((PyObject *)self, "name");
    if (name == NULL)
        return -1;
    PyErr_Format(type, "ring %S: corrupt record length %lld at cursor %lld", name, (long long)n, r);
    Py_DECREF(name);
    return -1;
}

/* Hand the room before cursor r back to the writer: store our cursor (release: after
 * the copies), then fence and ring the writer's doorbell if it sleeps (doorbell.py
 * NOTE), through self._wake_writer. Only while this reader is attached: a detached one
 * would free room in its successor's slot. The state is consistent before any Python
 * runs; Python may close the reader in _wake_writer, which raises ChannelClosedError
 * here, and the caller must not touch the mapping again. */
static int reader_publish(ReaderCore *self, long long r)
{
    if (reader_check_token(self) < 0)
        return -1;
    store_release(self->read_cursor, r);
    self->published = r;
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (!load_relaxed(self->writer_asleep))
        return 0;
    PyObject *result = call_method((PyObject *)self, "_wake_writer", NULL, 0);
    if (result == NULL)
        return -1;
    Py_DECREF(result);
    if (self->mem == NULL)
        return raise_closed((PyObject *)self, "reader");
    return 0;
}

/* The next record, or Py_None (a new reference) when nothing is published now. */
static PyObject *reader_try_recv(ReaderCore *self, PyObject *Py_UNUSED(ignored))
{
    for (;;) {
        if (self->mem == NULL) { /* closed, also by Python run in a publish below */
            raise_closed((PyObject *)self, "reader");
            return NULL;
        }
        long long r = self->r;
        if (r < 0) {
            reader_bad_length(self, 0, r);
            return NULL;
        }
        if (r == self->cached_w) {
            self->cached_w = load_acquire(self->write_cursor);
            if (r == self->cached_w) {
                if (r != self->published && reader_publish(self, r) < 0)
                    return NULL; /* caught up: hand all room back before idling */
                Py_RETURN_NONE;
            }
        }
        long long lap_pos = r % self->cap;
        const char *rec = self->mem + self->data_off + lap_pos;
        int64_t n = *(const int64_t *)rec;
        if (n == WRAP) { /* the next record starts the next lap */
            self->r = r + self->cap - lap_pos;
            if (self->r - self->published > self->publish_bytes && reader_publish(self, self->r) < 0)
                return NULL;
            continue;
        }
        if (n < 0 || n > self->cap - lap_pos - HEADER_BYTES) {
            reader_bad_length(self, n, r);
            return NULL;
        }
        PyObject *data = PyBytes_FromStringAndSize(rec + HEADER_BYTES, (Py_ssize_t)n);
        if (data == NULL)
            return NULL;
        if (reader_check_token(self) < 0) {
            Py_DECREF(data);
            return NULL;
        }
        self->r = r + record_bytes(n);
        if (self->r - self->published > self->publish_bytes && reader_publish(self, self->r) < 0) {
            Py_DECREF(data);
            return NULL;
        }
        return data;
    }
}

/* Nothing published now: self._recv_waiting(timeout_s, self.<poll_name>) spins, then
 * sleeps on the doorbell, polling with the given Python method. */
static PyObject *reader_wait(ReaderCore *self, PyObject *timeout, const char *poll_name)
{
    PyObject *poll = PyObject_GetAttrString((PyObject *)self, poll_name);
    if (poll == NULL)
        return NULL;
    PyObject *wait_args[2] = {timeout, poll};
    PyObject *result = call_method((PyObject *)self, "_recv_waiting", wait_args, 2);
    Py_DECREF(poll);
    return result;
}

static PyObject *reader_recv(ReaderCore *self, PyObject *const *args, Py_ssize_t nargs,
                             PyObject *kwnames)
{
    PyObject *timeout;
    if (parse_timeout("recv", args, nargs, kwnames, 0, &timeout) < 0)
        return NULL;
    PyObject *data = reader_try_recv(self, NULL);
    if (data != Py_None)
        return data;
    Py_DECREF(data);
    return reader_wait(self, timeout, "_poll");
}

static PyObject *reader_try_recv_many(ReaderCore *self, PyObject *Py_UNUSED(ignored))
{
    if (self->mem == NULL) {
        raise_closed((PyObject *)self, "reader");
        return NULL;
    }
    long long r = self->r;
    if (r < 0) {
        reader_bad_length(self, 0, r);
        return NULL;
    }
    long long w = load_acquire(self->write_cursor);
    if (r == w) {
        if (r != self->published && reader_publish(self, r) < 0)
            return NULL;
        return PyList_New(0);
    }
    self->cached_w = w;
    PyObject *records = PyList_New(0);
    if (records == NULL)
        return NULL;
    if (self->mem == NULL) { /* closed by Python code run by a GC that PyList_New started */
        Py_DECREF(records);
        raise_closed((PyObject *)self, "reader");
        return NULL;
    }
    long long budget = self->max_batch_bytes;
    long long publish_at = self->published + self->publish_bytes;
    /* r < w, not r != w: a detached reader that read an overwritten length may have
     * stepped past w; the token check after the loop then reports it. */
    while (r < w && budget > 0) {
        /* Records of one lap lie back to back; a wrap marker is a lap's last entry. */
        long long lap_pos = r % self->cap;
        long long span = w - r;
        if (span > self->cap - lap_pos)
            span = self->cap - lap_pos;
        if (span > budget)
            span = budget; /* records starting before the budget's end are read whole */
        const char *start = self->mem + self->data_off + lap_pos;
        const char *lap_end = start + (self->cap - lap_pos);
        const char *pos = start, *end = start + span;
        while (pos < end) {
            int64_t n = *(const int64_t *)pos;
            if (n == WRAP) { /* skip the rest of the lap */
                pos = lap_end;
                break;
            }
            if (n < 0 || n > lap_end - pos - HEADER_BYTES) {
                reader_bad_length(self, n, r + (pos - start));
                Py_DECREF(records);
                return NULL;
            }
            PyObject *data = PyBytes_FromStringAndSize(pos + HEADER_BYTES, (Py_ssize_t)n);
            if (data == NULL || PyList_Append(records, data) < 0) {
                Py_XDECREF(data);
                Py_DECREF(records);
                return NULL;
            }
            Py_DECREF(data);
            pos += record_bytes(n);
            /* Hand room back within a batch too, or a writer waiting on a full ring
             * would wait for the whole batch's copies. (reader_publish checks the
             * token first, so the copies so far are intact; after it the mapping may
             * be gone, and then it raises.) */
            if (r + (pos - start) > publish_at) {
                if (reader_publish(self, r + (pos - start)) < 0) {
                    /* The copies so far are lost to the caller, but not re-read: the
                     * writer may already reuse their room. */
                    if (self->published > self->r)
                        self->r = self->published;
                    Py_DECREF(records);
                    return NULL;
                }
                publish_at = self->published + self->publish_bytes;
            }
        }
        r += pos - start;
        budget -= pos - start;
    }
    if (reader_check_token(self) < 0) {
        Py_DECREF(records);
        return NULL;
    }
    if (r > w) { /* attached, yet past the write cursor: the ring is corrupt */
        Py_DECREF(records);
        reader_bad_length(self, 0, r);
        return NULL;
    }
    self->r = r;
    /* Publish every publish_bytes; and when the batch held only a wrap marker, now:
     * the caller sees no record and may go to sleep, while the writer waits for the
     * room behind the marker (with records, the caller's next call publishes). */
    if ((r - self->published > self->publish_bytes ||
         (PyList_GET_SIZE(records) == 0 && r != self->published)) &&
        reader_publish(self, r) < 0) {
        Py_DECREF(records);
        return NULL;
    }
    return records;
}

static PyObject *reader_recv_many(ReaderCore *self, PyObject *const *args, Py_ssize_t nargs,
                                  PyObject *kwnames)
{
    PyObject *timeout;
    if (parse_timeout("recv_many", args, nargs, kwnames, 0, &timeout) < 0)
        return NULL;
    PyObject *records = reader_try_recv_many(self, NULL);
    if (records == NULL || PyList_GET_SIZE(records) > 0)
        return records;
    Py_DECREF(records);
    return reader_wait(self, timeout, "_poll_many");
}

static PyMethodDef reader_methods[] = {
    {"_bind", (PyCFunction)reader_bind, METH_VARARGS,
     "_bind(buffer, write_cursor_word, token_word, read_cursor_word, writer_asleep_word, "
     "data_offset, capacity_bytes, max_batch_bytes): map the ring (the segment's mmap); "
     "words are int64 indices into it."},
    {"_unbind", (PyCFunction)reader_unbind, METH_NOARGS,
     "Release the buffer; later receives raise ChannelClosedError."},
    {"try_recv", (PyCFunction)reader_try_recv, METH_NOARGS,
     "try_recv() -> bytes | None: the next record's payload, or None if there is none "
     "now.\n\nRaises ReaderDetachedError if this reader was marked dead."},
    {"recv", (PyCFunction)(void (*)(void))reader_recv, METH_FASTCALL | METH_KEYWORDS,
     "recv(timeout_s=None) -> bytes: the next record's payload, waiting up to timeout_s "
     "seconds (None: forever).\n\nSpins for SPIN_NS, then sleeps on the doorbell (no CPU "
     "while idle).\nRaises TimeoutError (nothing arrived in time), ChannelClosedError "
     "(the writer closed the ring and everything was read), ReaderDetachedError."},
    {"try_recv_many", (PyCFunction)reader_try_recv_many, METH_NOARGS,
     "try_recv_many() -> list[bytes]: every record published now, oldest first; [] if "
     "none.\n\nAt most MAX_BATCH_BYTES (the record crossing it is read whole). One load "
     "of the write cursor and one detach check for the whole batch: the engine's "
     "channels read this way (codec.Channel). Raises ReaderDetachedError."},
    {"recv_many", (PyCFunction)(void (*)(void))reader_recv_many, METH_FASTCALL | METH_KEYWORDS,
     "recv_many(timeout_s=None) -> list[bytes]: every record published now, waiting up "
     "to timeout_s seconds for the first. Never returns an empty list; errors as recv."},
    {NULL}};

static PyMemberDef reader_members[] = {
    {"_r", T_LONGLONG, offsetof(ReaderCore, r), 0, "read cursor, bytes since creation"},
    {"_cached_w", T_LONGLONG, offsetof(ReaderCore, cached_w), 0, "last write cursor seen"},
    {"_published", T_LONGLONG, offsetof(ReaderCore, published), 0,
     "read cursor last stored for the writer"},
    {"_publish_bytes", T_LONGLONG, offsetof(ReaderCore, publish_bytes), 0,
     "publish the read cursor after this many bytes"},
    {"_token", T_LONGLONG, offsetof(ReaderCore, token), 0, "this attachment's token"},
    {NULL}};

static PyTypeObject ReaderCoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "flowengine.shm._ring.ReaderCore",
    .tp_basicsize = sizeof(ReaderCore),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "The per-record fast path of a ring reader (base class of RingReader).",
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)reader_dealloc,
    .tp_methods = reader_methods,
    .tp_members = reader_members,
};

/* ------------------------------------------------------------------------------ */

static PyObject *full_fence(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored))
{
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    Py_RETURN_NONE;
}

/* cas64(buffer, index, expected, desired) -> bool: one atomic compare-and-swap of
 * int64 word `index` of a writable buffer (the segment's mmap), sequentially
 * consistent (x86-64: lock cmpxchg). The slot locks of segment.py are built on it. */
static PyObject *cas64(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *buffer;
    Py_ssize_t index;
    long long expected, desired;
    if (!PyArg_ParseTuple(args, "OnLL:cas64", &buffer, &index, &expected, &desired))
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(buffer, &view, PyBUF_WRITABLE) < 0)
        return NULL;
    if (index < 0 || index > view.len / 8 - 1 || ((uintptr_t)view.buf & 7) != 0) {
        PyBuffer_Release(&view);
        PyErr_Format(PyExc_IndexError, "cas64: word %zd outside the 8-byte aligned buffer",
                     index);
        return NULL;
    }
    int64_t *word = (int64_t *)view.buf + index;
    int64_t seen = (int64_t)expected;
    int swapped = __atomic_compare_exchange_n(word, &seen, (int64_t)desired, 0,
                                              __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    PyBuffer_Release(&view);
    return PyBool_FromLong(swapped);
}

static PyMethodDef module_methods[] = {
    {"full_fence", full_fence, METH_NOARGS,
     "Issue a sequentially consistent fence (x86-64: mfence): every earlier load and "
     "store is ordered before every later one."},
    {"cas64", cas64, METH_VARARGS,
     "cas64(buffer, index, expected, desired) -> bool: atomically replace int64 word "
     "`index` of the writable buffer by `desired` if it equals `expected`. Raises "
     "IndexError outside the buffer, BufferError for a read-only one."},
    {NULL}};

static struct PyModuleDef ring_module = {
    PyModuleDef_HEAD_INIT, "flowengine.shm._ring",
    "C fast paths of the shared-memory rings (see _ring.c).", -1, module_methods};

PyMODINIT_FUNC PyInit__ring(void)
{
    if (PyType_Ready(&WriterCoreType) < 0 || PyType_Ready(&ReaderCoreType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&ring_module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "WriterCore", (PyObject *)&WriterCoreType) < 0 ||
        PyModule_AddObjectRef(m, "ReaderCore", (PyObject *)&ReaderCoreType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
