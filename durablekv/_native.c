/* durablekv._native: C kernels for the replay log, the page blobs and the
 * memory hit of Cache.get.
 *
 * Every function here has a pure-Python twin (durablekv/log/segments.py,
 * durablekv/codec.py, durablekv/stores/pageformat.py) that stays the
 * reference: the on-disk bytes are the same byte for byte, and where input
 * is damaged or of an unusual shape the kernel hands back to the Python
 * code (returns None, or stops before the record) so that every error and
 * its message comes from one place. durablekv/_accel.py decides which runs.
 *
 * CRC-32 is the zlib polynomial (0xEDB88320, reflected, init and final
 * xor 0xFFFFFFFF), computed by slicing-by-8 (Kounavis and Berry, "A
 * Systematic Approach to Building High Performance Software-based CRC
 * Generators", 2005), so the module needs no library beyond Python's.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <errno.h>
#include <unistd.h>
#ifdef DURABLEKV_ZLIB
#include <zlib.h>
#endif

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "durablekv._native assumes a little-endian machine; the pure-Python code is used instead"
#endif

/* "No expiry" in a log record or a page blob: the quiet NaN whose bytes
 * struct.pack("<d", float("nan")) gives (sign bit clear), so that the
 * kernels write what the Python code writes. Not Py_NAN: before Python 3.11
 * that is Py_HUGE_VAL * 0., which x86 makes a NaN with the sign bit set. */
static inline double
no_expiry(void)
{
    const uint64_t bits = 0x7ff8000000000000ull;
    double d;
    memcpy(&d, &bits, 8);
    return d;
}

/* ---------------------------------------------------------------- CRC-32 */

static uint32_t crc_table[8][256];

static void crc_init(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = (c >> 1) ^ (0xEDB88320u & (0u - (c & 1u)));
        crc_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = crc_table[0][i];
        for (int t = 1; t < 8; t++) {
            c = crc_table[0][c & 0xFF] ^ (c >> 8);
            crc_table[t][i] = c;
        }
    }
}

/* zlib.crc32(buf, crc); zlib's own where the build found it (faster on
 * long input), else slicing-by-8. */
static uint32_t crc32_update(uint32_t crc, const unsigned char *p, size_t n)
{
#ifdef DURABLEKV_ZLIB
    if (n >= 256 && n <= 0x7FFFFFFF)
        return (uint32_t)crc32((uLong)crc, p, (uInt)n);
#endif
    crc = ~crc;
    while (n && ((uintptr_t)p & 7)) {
        crc = crc_table[0][(crc ^ *p++) & 0xFF] ^ (crc >> 8);
        n--;
    }
    while (n >= 8) {
        uint32_t a, b;
        memcpy(&a, p, 4);
        memcpy(&b, p + 4, 4);
        a ^= crc;
        crc = crc_table[7][a & 0xFF] ^ crc_table[6][(a >> 8) & 0xFF] ^
              crc_table[5][(a >> 16) & 0xFF] ^ crc_table[4][a >> 24] ^
              crc_table[3][b & 0xFF] ^ crc_table[2][(b >> 8) & 0xFF] ^
              crc_table[1][(b >> 16) & 0xFF] ^ crc_table[0][b >> 24];
        p += 8;
        n -= 8;
    }
    while (n--)
        crc = crc_table[0][(crc ^ *p++) & 0xFF] ^ (crc >> 8);
    return ~crc;
}

static inline void put_u16(unsigned char *p, uint16_t v) { memcpy(p, &v, 2); }
static inline void put_u32(unsigned char *p, uint32_t v) { memcpy(p, &v, 4); }
static inline void put_u64(unsigned char *p, uint64_t v) { memcpy(p, &v, 8); }
static inline void put_f64(unsigned char *p, double v) { memcpy(p, &v, 8); }
static inline uint16_t get_u16(const unsigned char *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline uint32_t get_u32(const unsigned char *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline uint64_t get_u64(const unsigned char *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static inline double get_f64(const unsigned char *p) { double v; memcpy(&v, p, 8); return v; }

static PyObject *
py_crc32(PyObject *Py_UNUSED(self), PyObject *args)
{
    Py_buffer buf;
    unsigned int seed = 0;
    if (!PyArg_ParseTuple(args, "y*|I:crc32", &buf, &seed))
        return NULL;
    uint32_t c = crc32_update(seed, buf.buf, (size_t)buf.len);
    PyBuffer_Release(&buf);
    return PyLong_FromUnsignedLong(c);
}

/* ---------------------------------------------------------- log records */

#define HSIZE 16   /* <IIQ length | crc | lsn */
#define PSIZE 13   /* <BdI op | expire_at | key length */
#define MAX_RECORD (1ull << 31)

/* Fill ``out`` (HSIZE + PSIZE + klen + vlen bytes) with one record. */
static void
build_record(unsigned char *out, uint64_t lsn, unsigned op, double exp,
             const char *key, Py_ssize_t klen, const char *value, Py_ssize_t vlen,
             int bytes_tag)
{
    /* bytes_tag: the value is a bytes object's raw data, written as the safe
     * codec's encoding of it (tag 'b', u32 length, the bytes) */
    Py_ssize_t tag = bytes_tag ? 5 : 0;
    uint32_t n = (uint32_t)(PSIZE + klen + tag + vlen);
    unsigned char *pl = out + HSIZE;
    pl[0] = (unsigned char)op;
    put_f64(pl + 1, exp);
    put_u32(pl + 9, (uint32_t)klen);
    memcpy(pl + PSIZE, key, (size_t)klen);
    if (bytes_tag) {
        pl[PSIZE + klen] = 'b';
        put_u32(pl + PSIZE + klen + 1, (uint32_t)vlen);
    }
    memcpy(pl + PSIZE + klen + tag, value, (size_t)vlen);
    put_u32(out, n);
    put_u64(out + 8, lsn);
    /* CRC of <IQ (length, lsn) then the payload: bytes 0..4 then 8..end */
    uint32_t crc = crc32_update(0, out, 4);
    crc = crc32_update(crc, out + 8, (size_t)n + 8);
    put_u32(out + 4, crc);
}

/* Parse (lsn, op, key, value, expire_at) as struct would, or fail with the
 * exception struct raises (struct.error is what the Python path raises for an
 * out-of-range op or key length; the caller falls back to it on any error). */
static int
record_args(PyObject *const *args, Py_ssize_t nargs, const char *name,
            unsigned long long *lsn, unsigned *op, double *exp)
{
    if (nargs != 5 && nargs != 6) {
        PyErr_Format(PyExc_TypeError, "%s takes %s arguments", name,
                     nargs < 5 ? "more" : "fewer");
        return -1;
    }
    int off = nargs == 6;  /* write_record: fd first */
    *lsn = PyLong_AsUnsignedLongLong(args[off]);
    if (*lsn == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    long o = PyLong_AsLong(args[off + 1]);
    if (o == -1 && PyErr_Occurred())
        return -1;
    if (o < 0 || o > 255) {
        PyErr_SetString(PyExc_OverflowError, "op out of range");
        return -1;
    }
    *op = (unsigned)o;
    if (!PyBytes_CheckExact(args[off + 2]) || !PyBytes_CheckExact(args[off + 3])) {
        PyErr_SetString(PyExc_TypeError, "key and value must be bytes");
        return -1;
    }
    PyObject *e = args[off + 4];
    if (e == Py_None) {
        *exp = no_expiry();
    } else {
        *exp = PyFloat_AsDouble(e);
        if (*exp == -1.0 && PyErr_Occurred())
            return -1;
    }
    Py_ssize_t klen = PyBytes_GET_SIZE(args[off + 2]), vlen = PyBytes_GET_SIZE(args[off + 3]);
    if ((unsigned long long)klen > 0xFFFFFFFFull ||
            (unsigned long long)(PSIZE + klen + vlen) > 0xFFFFFFFFull) {
        PyErr_SetString(PyExc_OverflowError, "record too large");
        return -1;
    }
    return 0;
}

/* encode_record(lsn, op, key, value, expire_at) -> bytes */
static PyObject *
py_encode_record(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs)
{
    unsigned long long lsn;
    unsigned op;
    double exp;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "encode_record takes 5 arguments");
        return NULL;
    }
    if (record_args(args, nargs, "encode_record", &lsn, &op, &exp) < 0)
        return NULL;
    Py_ssize_t klen = PyBytes_GET_SIZE(args[2]), vlen = PyBytes_GET_SIZE(args[3]);
    PyObject *out = PyBytes_FromStringAndSize(NULL, HSIZE + PSIZE + klen + vlen);
    if (out == NULL)
        return NULL;
    build_record((unsigned char *)PyBytes_AS_STRING(out), lsn, op, exp,
                 PyBytes_AS_STRING(args[2]), klen, PyBytes_AS_STRING(args[3]), vlen, 0);
    return out;
}

/* write_record(fd, lsn, op, key, value, expire_at) -> (written, size)
 * write_bytes_record(fd, lsn, op, key, raw, expire_at) -> (written, size)
 *
 * Build the record and write it with one write(2), the GIL released around
 * the call as os.write does; EINTR is retried as os.write does (PEP 475),
 * running signal handlers first. Raises OSError as os.write.
 * write_bytes_record logs the value b"b" + u32(len(raw)) + raw (the safe
 * codec's encoding of a bytes value) without building it first. */
static PyObject *
write_any(PyObject *const *args, Py_ssize_t nargs, int bytes_tag, const char *name)
{
    unsigned long long lsn;
    unsigned op;
    double exp;
    if (nargs != 6) {
        PyErr_Format(PyExc_TypeError, "%s takes 6 arguments", name);
        return NULL;
    }
    int fd = PyLong_AsLong(args[0]) ;
    if (fd == -1 && PyErr_Occurred())
        return NULL;
    if (record_args(args, nargs, name, &lsn, &op, &exp) < 0)
        return NULL;
    Py_ssize_t klen = PyBytes_GET_SIZE(args[3]), vlen = PyBytes_GET_SIZE(args[4]);
    if (bytes_tag && (unsigned long long)(PSIZE + klen + 5 + vlen) > 0xFFFFFFFFull) {
        PyErr_SetString(PyExc_OverflowError, "record too large");
        return NULL;
    }
    size_t size = (size_t)(HSIZE + PSIZE + klen + (bytes_tag ? 5 : 0) + vlen);
    unsigned char stack[1024];
    unsigned char *buf = size <= sizeof stack ? stack : PyMem_RawMalloc(size);
    if (buf == NULL)
        return PyErr_NoMemory();
    build_record(buf, lsn, op, exp, PyBytes_AS_STRING(args[3]), klen,
                 PyBytes_AS_STRING(args[4]), vlen, bytes_tag);
    ssize_t n;
    int err;
    do {
        Py_BEGIN_ALLOW_THREADS
        n = write(fd, buf, size);
        err = errno;
        Py_END_ALLOW_THREADS
    } while (n < 0 && err == EINTR && !PyErr_CheckSignals());
    if (buf != stack)
        PyMem_RawFree(buf);
    if (n < 0) {
        if (!PyErr_Occurred()) {
            errno = err;
            PyErr_SetFromErrno(PyExc_OSError);
        }
        return NULL;
    }
    return Py_BuildValue("(nn)", (Py_ssize_t)n, (Py_ssize_t)size);
}

static PyObject *
py_write_record(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs)
{
    return write_any(args, nargs, 0, "write_record");
}

static PyObject *
py_write_bytes_record(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs)
{
    return write_any(args, nargs, 1, "write_bytes_record");
}

/* store_record(buf, offset, lsn, op, key, value, expire_at) -> size
 * store_bytes_record(buf, offset, lsn, op, key, raw, expire_at) -> size
 *
 * Build the record straight into the writable buffer ``buf`` (the mapping
 * of a preallocated log segment) at ``offset``: the same bytes
 * write_record writes. Returns the record's size, or minus its size when it
 * does not fit in ``buf`` from ``offset`` (nothing is stored then). */
static PyObject *
store_any(PyObject *const *args, Py_ssize_t nargs, int bytes_tag, const char *name)
{
    unsigned long long lsn;
    unsigned op;
    double exp;
    if (nargs != 7) {
        PyErr_Format(PyExc_TypeError, "%s takes 7 arguments", name);
        return NULL;
    }
    Py_ssize_t offset = PyLong_AsSsize_t(args[1]);
    if (offset == -1 && PyErr_Occurred())
        return NULL;
    if (record_args(args + 1, 6, name, &lsn, &op, &exp) < 0)
        return NULL;
    Py_ssize_t klen = PyBytes_GET_SIZE(args[4]), vlen = PyBytes_GET_SIZE(args[5]);
    if (bytes_tag && (unsigned long long)(PSIZE + klen + 5 + vlen) > 0xFFFFFFFFull) {
        PyErr_SetString(PyExc_OverflowError, "record too large");
        return NULL;
    }
    Py_ssize_t size = HSIZE + PSIZE + klen + (bytes_tag ? 5 : 0) + vlen;
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_WRITABLE) < 0)
        return NULL;
    if (offset < 0 || offset > view.len || view.len - offset < size) {
        PyBuffer_Release(&view);
        return PyLong_FromSsize_t(-size);
    }
    build_record((unsigned char *)view.buf + offset, lsn, op, exp, PyBytes_AS_STRING(args[4]),
                 klen, PyBytes_AS_STRING(args[5]), vlen, bytes_tag);
    PyBuffer_Release(&view);
    return PyLong_FromSsize_t(size);
}

static PyObject *
py_store_record(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs)
{
    return store_any(args, nargs, 0, "store_record");
}

static PyObject *
py_store_bytes_record(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs)
{
    return store_any(args, nargs, 1, "store_bytes_record");
}

/* parse_segment(data, pos) -> (records, pos, stopped)
 *
 * Parses records from ``pos`` exactly as logsegments._parse_segment's
 * general path takes them; stops at the first record that path would
 * refuse (``stopped`` True) or at the end of ``data``. The caller lets the
 * Python parser describe the damage at ``pos``. */
static PyObject *
py_parse_segment(PyObject *Py_UNUSED(self), PyObject *args)
{
    Py_buffer buf;
    Py_ssize_t pos;
    if (!PyArg_ParseTuple(args, "y*n:parse_segment", &buf, &pos))
        return NULL;
    const unsigned char *d = buf.buf;
    Py_ssize_t size = buf.len;
    PyObject *records = PyList_New(0);
    if (records == NULL)
        goto fail;
    /* one seed per length: the CRC of the 4 length bytes */
    uint32_t last_n = 0, seed = 0;
    int have_seed = 0;
    PyObject *last_op[4] = {NULL, NULL, NULL, NULL};
    int stopped = 0;
    if (pos < 0)
        pos = 0;
    while (pos < size) {
        if (pos + HSIZE > size) { stopped = 1; break; }
        const unsigned char *r = d + pos;
        uint32_t n = get_u32(r), crc = get_u32(r + 4);
        uint64_t lsn = get_u64(r + 8);
        if (n < PSIZE || (uint64_t)n > MAX_RECORD) { stopped = 1; break; }
        Py_ssize_t end = pos + HSIZE + (Py_ssize_t)n;
        if (end > size) { stopped = 1; break; }
        if (!have_seed || n != last_n) {
            seed = crc32_update(0, r, 4);
            last_n = n;
            have_seed = 1;
        }
        if (crc32_update(seed, r + 8, (size_t)n + 8) != crc) { stopped = 1; break; }
        unsigned op = r[HSIZE];
        double exp = get_f64(r + HSIZE + 1);
        uint32_t klen = get_u32(r + HSIZE + 9);
        if (op < 1 || op > 3 || (uint64_t)PSIZE + klen > n) { stopped = 1; break; }
        PyObject *t = PyTuple_New(5);
        if (t == NULL)
            goto fail;
        PyObject *o;
        if ((o = PyLong_FromUnsignedLongLong(lsn)) == NULL) { Py_DECREF(t); goto fail; }
        PyTuple_SET_ITEM(t, 0, o);
        if (last_op[op] == NULL && (last_op[op] = PyLong_FromLong(op)) == NULL) {
            Py_DECREF(t); goto fail;
        }
        Py_INCREF(last_op[op]);
        PyTuple_SET_ITEM(t, 1, last_op[op]);
        const char *k = (const char *)r + HSIZE + PSIZE;
        if ((o = PyBytes_FromStringAndSize(k, klen)) == NULL) { Py_DECREF(t); goto fail; }
        PyTuple_SET_ITEM(t, 2, o);
        if ((o = PyBytes_FromStringAndSize(k + klen, (Py_ssize_t)(n - PSIZE - klen))) == NULL) {
            Py_DECREF(t); goto fail;
        }
        PyTuple_SET_ITEM(t, 3, o);
        if (isnan(exp)) {
            Py_INCREF(Py_None);
            o = Py_None;
        } else if ((o = PyFloat_FromDouble(exp)) == NULL) {
            Py_DECREF(t); goto fail;
        }
        PyTuple_SET_ITEM(t, 4, o);
        if (PyList_Append(records, t) < 0) { Py_DECREF(t); goto fail; }
        Py_DECREF(t);
        pos = end;
    }
    for (int i = 0; i < 4; i++)
        Py_XDECREF(last_op[i]);
    PyBuffer_Release(&buf);
    {
        PyObject *res = Py_BuildValue("(NnO)", records, pos, stopped ? Py_True : Py_False);
        return res;
    }
fail:
    for (int i = 0; i < 4; i++)
        Py_XDECREF(last_op[i]);
    Py_XDECREF(records);
    PyBuffer_Release(&buf);
    return NULL;
}

/* ------------------------------------------------------- keys and values */

/* decode_keys(blobs, decode_key) -> (keys, others): codec.decode_keys, with
 * str and int64 keys decoded here and any other key by ``decode_key``. */
static PyObject *
py_decode_keys(PyObject *Py_UNUSED(self), PyObject *args)
{
    PyObject *blobs, *slow;
    if (!PyArg_ParseTuple(args, "OO:decode_keys", &blobs, &slow))
        return NULL;
    PyObject *seq = PySequence_Fast(blobs, "decode_keys needs an iterable of bytes");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *keys = PyList_New(n), *others = PyList_New(0);
    if (keys == NULL || others == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *b = items[i], *key = NULL;
        int other = 0;
        if (PyBytes_CheckExact(b)) {
            const unsigned char *p = (const unsigned char *)PyBytes_AS_STRING(b);
            Py_ssize_t len = PyBytes_GET_SIZE(b);
            if (len >= 5 && p[0] == 's' && (Py_ssize_t)get_u32(p + 1) == len - 5) {
                key = PyUnicode_DecodeUTF8((const char *)p + 5, len - 5, "surrogatepass");
                if (key == NULL)
                    goto fail;
            } else if (len == 9 && p[0] == 'q') {
                key = PyLong_FromLongLong((long long)get_u64(p + 1));
                if (key == NULL)
                    goto fail;
                other = 1;
            }
        }
        if (key == NULL) {
            key = PyObject_CallOneArg(slow, b);
            if (key == NULL)
                goto fail;
            other = !PyBytes_CheckExact(key) && !PyUnicode_CheckExact(key);
        }
        PyList_SET_ITEM(keys, i, key);
        if (other) {
            PyObject *ix = PyLong_FromSsize_t(i);
            if (ix == NULL || PyList_Append(others, ix) < 0) {
                Py_XDECREF(ix);
                goto fail;
            }
            Py_DECREF(ix);
        }
    }
    Py_DECREF(seq);
    return Py_BuildValue("(NN)", keys, others);
fail:
    Py_DECREF(seq);
    Py_XDECREF(keys);
    Py_XDECREF(others);
    return NULL;
}

/* memory_forms(blobs, slow) -> list: SafeCodec.memory_forms_from_blobs; a
 * bytes value's encoding becomes the bytes, anything else slow(blob). */
static PyObject *
py_memory_forms(PyObject *Py_UNUSED(self), PyObject *args)
{
    PyObject *blobs, *slow;
    if (!PyArg_ParseTuple(args, "OO:memory_forms", &blobs, &slow))
        return NULL;
    PyObject *seq = PySequence_Fast(blobs, "memory_forms needs an iterable of bytes");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *out = PyList_New(n);
    if (out == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *b = items[i], *v;
        const unsigned char *p;
        Py_ssize_t len;
        if (PyBytes_CheckExact(b) && (len = PyBytes_GET_SIZE(b)) >= 5 &&
                (p = (const unsigned char *)PyBytes_AS_STRING(b))[0] == 'b' &&
                (Py_ssize_t)get_u32(p + 1) == len - 5)
            v = PyBytes_FromStringAndSize((const char *)p + 5, len - 5);
        else
            v = PyObject_CallOneArg(slow, b);
        if (v == NULL)
            goto fail;
        PyList_SET_ITEM(out, i, v);
    }
    Py_DECREF(seq);
    return out;
fail:
    Py_DECREF(seq);
    Py_XDECREF(out);
    return NULL;
}

/* ------------------------------------------------------------ page blobs */

#define ASCII_KEYS 1
#define RAW_BYTES 2
#define NO_TTL 4
#define INT_KEYS 8
#define ALL_FLAGS (ASCII_KEYS | RAW_BYTES | NO_TTL | INT_KEYS)

/* page_columns(data) -> (slots, expires, flags, keys, values) or None
 *
 * pageformat.page_columns for a valid version-2 blob; None for anything the
 * Python function would refuse (it then raises the error). */
static PyObject *
py_page_columns(PyObject *Py_UNUSED(self), PyObject *arg)
{
    if (!PyBytes_CheckExact(arg))
        Py_RETURN_NONE;
    const unsigned char *d = (const unsigned char *)PyBytes_AS_STRING(arg);
    Py_ssize_t size = PyBytes_GET_SIZE(arg);
    if (size < 5 || get_u16(d) != 0xFFFF)
        Py_RETURN_NONE;
    Py_ssize_t n = get_u16(d + 2);
    unsigned flags = d[4];
    int ttl = !(flags & NO_TTL);
    Py_ssize_t start = 5 + 2 * n + (ttl ? 8 * n : 0) + 8 * n;
    if (size < start)
        Py_RETURN_NONE;
    if ((flags & ~ALL_FLAGS) || ((flags & ASCII_KEYS) && (flags & INT_KEYS)))
        Py_RETURN_NONE;
    const unsigned char *sl = d + 5, *ex = sl + 2 * n;
    const unsigned char *kl = ex + (ttl ? 8 * n : 0), *vl = kl + 4 * n;
    unsigned long long total = (unsigned long long)start;
    for (Py_ssize_t i = 0; i < n; i++)
        total += (unsigned long long)get_u32(kl + 4 * i) + get_u32(vl + 4 * i);
    if (total != (unsigned long long)size)
        Py_RETURN_NONE;
    if (flags & INT_KEYS)
        for (Py_ssize_t i = 0; i < n; i++)
            if (get_u32(kl + 4 * i) != 8)
                Py_RETURN_NONE;
    if (flags & ASCII_KEYS) {
        Py_ssize_t kend = start;
        for (Py_ssize_t i = 0; i < n; i++)
            kend += get_u32(kl + 4 * i);
        for (Py_ssize_t i = start; i < kend; i++)
            if (d[i] & 0x80)
                Py_RETURN_NONE;
    }
    PyObject *slots = PyTuple_New(n), *exps = PyList_New(n), *keys = PyList_New(n),
             *values = PyList_New(n);
    if (!slots || !exps || !keys || !values)
        goto fail;
    Py_ssize_t kp = start, vp = start;
    for (Py_ssize_t i = 0; i < n; i++)
        vp += get_u32(kl + 4 * i);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = PyLong_FromLong(get_u16(sl + 2 * i));
        if (o == NULL)
            goto fail;
        PyTuple_SET_ITEM(slots, i, o);
        if (ttl) {
            double e = get_f64(ex + 8 * i);
            if (isnan(e)) {
                Py_INCREF(Py_None);
                o = Py_None;
            } else if ((o = PyFloat_FromDouble(e)) == NULL) {
                goto fail;
            }
        } else {
            Py_INCREF(Py_None);
            o = Py_None;
        }
        PyList_SET_ITEM(exps, i, o);
        Py_ssize_t klen = get_u32(kl + 4 * i), vlen = get_u32(vl + 4 * i);
        if (flags & INT_KEYS)
            o = PyLong_FromLongLong((long long)get_u64(d + kp));
        else if (flags & ASCII_KEYS)
            o = PyUnicode_DecodeASCII((const char *)d + kp, klen, NULL);
        else
            o = PyBytes_FromStringAndSize((const char *)d + kp, klen);
        if (o == NULL)
            goto fail;
        PyList_SET_ITEM(keys, i, o);
        kp += klen;
        if ((o = PyBytes_FromStringAndSize((const char *)d + vp, vlen)) == NULL)
            goto fail;
        PyList_SET_ITEM(values, i, o);
        vp += vlen;
    }
    return Py_BuildValue("(NNINN)", slots, exps, flags, keys, values);
fail:
    Py_XDECREF(slots);
    Py_XDECREF(exps);
    Py_XDECREF(keys);
    Py_XDECREF(values);
    return NULL;
}

/* encode_columns(slots, kbs, vbs, expires, flags) -> bytes or None
 *
 * pageformat.encode_columns; None for input the Python function handles
 * differently (a slot outside u16, an item not bytes, too many entries),
 * which then runs it and raises its error. */
static PyObject *
py_encode_columns(PyObject *Py_UNUSED(self), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "encode_columns takes 5 arguments");
        return NULL;
    }
    PyObject *s = args[0], *k = args[1], *v = args[2], *e = args[3];
    if (!(PyList_CheckExact(s) || PyTuple_CheckExact(s)) ||
            !(PyList_CheckExact(k) || PyTuple_CheckExact(k)) ||
            !(PyList_CheckExact(v) || PyTuple_CheckExact(v)) ||
            !(PyList_CheckExact(e) || PyTuple_CheckExact(e)))
        Py_RETURN_NONE;
    long flags = PyLong_AsLong(args[4]);
    if (flags == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(s);
    if (n > 0xFFFF || PySequence_Fast_GET_SIZE(k) != n || PySequence_Fast_GET_SIZE(v) != n ||
            PySequence_Fast_GET_SIZE(e) != n || flags < 0 || flags > 255)
        Py_RETURN_NONE;
    PyObject **si = PySequence_Fast_ITEMS(s), **ki = PySequence_Fast_ITEMS(k),
             **vi = PySequence_Fast_ITEMS(v), **ei = PySequence_Fast_ITEMS(e);
    int ttl = 0;
    size_t body = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyLong_CheckExact(si[i]) || !PyBytes_CheckExact(ki[i]) || !PyBytes_CheckExact(vi[i]))
            Py_RETURN_NONE;
        if (PyBytes_GET_SIZE(ki[i]) > 0xFFFFFFFFll || PyBytes_GET_SIZE(vi[i]) > 0xFFFFFFFFll)
            Py_RETURN_NONE;
        if (ei[i] != Py_None) {
            if (!PyFloat_CheckExact(ei[i]))
                Py_RETURN_NONE;
            ttl = 1;
        }
        body += (size_t)PyBytes_GET_SIZE(ki[i]) + (size_t)PyBytes_GET_SIZE(vi[i]);
    }
    size_t head = 5 + 2 * (size_t)n + (ttl ? 8 * (size_t)n : 0) + 8 * (size_t)n;
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(head + body));
    if (out == NULL)
        return NULL;
    unsigned char *p = (unsigned char *)PyBytes_AS_STRING(out);
    put_u16(p, 0xFFFF);
    put_u16(p + 2, (uint16_t)n);
    p[4] = (unsigned char)(ttl ? flags : (flags | NO_TTL));
    unsigned char *sl = p + 5, *ex = sl + 2 * n, *kl = ex + (ttl ? 8 * n : 0), *vl = kl + 4 * n;
    unsigned char *kp = vl + 4 * n;
    for (Py_ssize_t i = 0; i < n; i++) {
        long slot = PyLong_AsLong(si[i]);
        if (slot < 0 || slot > 0xFFFF) {
            PyErr_Clear();
            Py_DECREF(out);
            Py_RETURN_NONE;
        }
        put_u16(sl + 2 * i, (uint16_t)slot);
        if (ttl)
            put_f64(ex + 8 * i, ei[i] == Py_None ? no_expiry() : PyFloat_AS_DOUBLE(ei[i]));
        Py_ssize_t klen = PyBytes_GET_SIZE(ki[i]);
        put_u32(kl + 4 * i, (uint32_t)klen);
        put_u32(vl + 4 * i, (uint32_t)PyBytes_GET_SIZE(vi[i]));
        memcpy(kp, PyBytes_AS_STRING(ki[i]), (size_t)klen);
        kp += klen;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t vlen = PyBytes_GET_SIZE(vi[i]);
        memcpy(kp, PyBytes_AS_STRING(vi[i]), (size_t)vlen);
        kp += vlen;
    }
    return out;
}

/* ---------------------------------------------------------------- memory hit
 *
 * hit_getter(cache, fast) -> a callable get(key, default=None) that Cache installs as its instance's
 * ``get``: the lock-free memory hit of Cache.get (durablekv/cache.py), the
 * same steps in the same order, with no Python frame. Anything but a plain
 * memory hit (a miss, an entry with a TTL, a page not resident, an old
 * midpoint entry, a frozen value, a closed cache, keywords) calls ``slow``,
 * the Python Cache.get, with the same arguments: one place decides every
 * other case and raises every error. ``fast`` is the cache's
 * durablekv.fastpath.FastPath: the fields below are read from it once, here
 * (table, ticks, open, has_ttl, frozen, resident, slotted, and get as
 * ``slow``). The getter holds the cache; Cache
 * drops it from its __dict__ at close, which ends the reference cycle (and
 * tp_traverse lets the collector end it otherwise).
 */

typedef struct {
    PyObject_HEAD
    PyObject *cache;     /* the Cache */
    PyObject *table;     /* its page table: key -> (page, slot, value) */
    PyObject *ticks;     /* the tier's itertools.count: LRU clock and hit count */
    PyObject *open;      /* the _OPEN state object */
    PyObject *has_ttl;   /* HAS_TTL: the value is checked under the lock */
    PyObject *frozen;    /* codec.Frozen: decoded on every read (slow path) */
    PyObject *slow;      /* Cache.get, the Python function */
    long resident, slotted;
} HitState;

static PyObject *s_state, *s_pstate, *s_stamp, *s_stamps, *s_get, *s_set, *s_reduce_ex;

/* The method ``name`` as the cache's class now has it, when it is no longer
 * ``orig`` (a test patched Cache.get on the class, e.g. with
 * unittest.mock.patch.object): the call goes there, bound as attribute
 * lookup binds it, so that the instance attribute does not hide the patch.
 * NULL with no error: not patched. */
static PyObject *
call_patched(PyObject *cache, PyObject *name, PyObject *orig, PyObject *const *args,
             size_t nargsf, PyObject *kwnames, int *patched)
{
    PyObject *type = (PyObject *)Py_TYPE(cache);
    PyObject *cur = PyObject_GetAttr(type, name);
    if (cur == NULL) {
        *patched = 1;
        return NULL;
    }
    if (cur == orig) {
        Py_DECREF(cur);
        *patched = 0;
        return NULL;
    }
    *patched = 1;
    PyObject *fn = cur;
    descrgetfunc bind = Py_TYPE(cur)->tp_descr_get;
    if (bind != NULL) {
        fn = bind(cur, cache, type);
        Py_DECREF(cur);
        if (fn == NULL)
            return NULL;
    }
    PyObject *r = PyObject_Vectorcall(fn, args, PyVectorcall_NARGS(nargsf), kwnames);
    Py_DECREF(fn);
    return r;
}

/* __reduce__ of a getter's or setter's state: the cache's own refusal
 * (a Cache cannot be pickled, and says why). */
static PyObject *
state_reduce(PyObject *cache)
{
    if (cache == NULL) {
        PyErr_SetString(PyExc_TypeError, "a durablekv cache method cannot be pickled");
        return NULL;
    }
    PyObject *protocol = PyLong_FromLong(2);
    if (protocol == NULL)
        return NULL;
    PyObject *r = PyObject_CallMethodOneArg(cache, s_reduce_ex, protocol);
    Py_DECREF(protocol);
    return r;
}

static int
hit_traverse(HitState *self, visitproc visit, void *arg)
{
    Py_VISIT(self->cache);
    Py_VISIT(self->table);
    Py_VISIT(self->ticks);
    Py_VISIT(self->open);
    Py_VISIT(self->has_ttl);
    Py_VISIT(self->frozen);
    Py_VISIT(self->slow);
    return 0;
}

static int
hit_clear(HitState *self)
{
    Py_CLEAR(self->cache);
    Py_CLEAR(self->table);
    Py_CLEAR(self->ticks);
    Py_CLEAR(self->open);
    Py_CLEAR(self->has_ttl);
    Py_CLEAR(self->frozen);
    Py_CLEAR(self->slow);
    return 0;
}

static void
hit_dealloc(HitState *self)
{
    PyObject_GC_UnTrack(self);
    hit_clear(self);
    PyObject_GC_Del(self);
}

static PyObject *
hit_reduce(HitState *self, PyObject *Py_UNUSED(ignored))
{
    return state_reduce(self->cache);
}

static PyMethodDef hit_state_methods[] = {
    {"__reduce__", (PyCFunction)hit_reduce, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject HitStateType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "durablekv._native.HitState",
    .tp_basicsize = sizeof(HitState),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_traverse = (traverseproc)hit_traverse,
    .tp_clear = (inquiry)hit_clear,
    .tp_dealloc = (destructor)hit_dealloc,
    .tp_methods = hit_state_methods,
};

/* slow(cache, *args, **kwargs) */
static PyObject *
call_slow(PyObject *cache, PyObject *slow, PyObject *const *args, size_t nargsf,
          PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    Py_ssize_t total = nargs + (kwnames ? PyTuple_GET_SIZE(kwnames) : 0);
    if (cache == NULL) {  /* only after the collector cleared the state */
        PyErr_SetString(PyExc_RuntimeError, "this durablekv cache method outlived its cache");
        return NULL;
    }
    PyObject *small[8];
    PyObject **stack = small;
    if (total + 1 > 8) {
        stack = PyMem_Malloc((size_t)(total + 1) * sizeof(PyObject *));
        if (stack == NULL)
            return PyErr_NoMemory();
    }
    stack[0] = cache;
    for (Py_ssize_t i = 0; i < total; i++)
        stack[i + 1] = args[i];
    PyObject *r = PyObject_Vectorcall(slow, stack, (size_t)(nargs + 1), kwnames);
    if (stack != small)
        PyMem_Free(stack);
    return r;
}

/* The stamp for this hit: next(ticks), or NULL with an error set. */
static inline PyObject *
hit_tick(HitState *st)
{
    PyObject *t = PyIter_Next(st->ticks);
    if (t == NULL && !PyErr_Occurred())
        PyErr_SetString(PyExc_RuntimeError, "the LRU clock stopped");
    return t;
}

static PyObject *
hit_get(PyObject *self, PyObject *const *args, Py_ssize_t nargsf, PyObject *kwnames)
{
    HitState *st = (HitState *)self;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (st->cache != NULL) {
        int patched;
        PyObject *r = call_patched(st->cache, s_get, st->slow, args, (size_t)nargsf, kwnames,
                                   &patched);
        if (patched)
            return r;
    }
    if (kwnames != NULL || nargs < 1 || nargs > 2 || st->cache == NULL)
        goto slow;
    PyObject *state = PyObject_GetAttr(st->cache, s_state);
    if (state == NULL)
        return NULL;
    Py_DECREF(state);  /* only its identity is compared */
    if (state != st->open)
        goto slow;
    PyObject *ref = PyDict_GetItemWithError(st->table, args[0]);  /* borrowed */
    if (ref == NULL) {
        if (PyErr_Occurred()) {
            /* an unhashable key: the slow path raises the TypeError set()
               gives, as Cache.get's own lookup catches only TypeError; any
               other error of the key's __hash__ or __eq__ propagates */
            if (!PyErr_ExceptionMatches(PyExc_TypeError))
                return NULL;
            PyErr_Clear();
        }
        goto slow;
    }
    PyObject *page, *slot, *v;
    if (PyTuple_CheckExact(ref) && PyTuple_GET_SIZE(ref) == 3) {
        page = PyTuple_GET_ITEM(ref, 0);
        slot = PyTuple_GET_ITEM(ref, 1);
        v = PyTuple_GET_ITEM(ref, 2);
    } else if (PyList_CheckExact(ref) && PyList_GET_SIZE(ref) == 3) {
        page = PyList_GET_ITEM(ref, 0);
        slot = PyList_GET_ITEM(ref, 1);
        v = PyList_GET_ITEM(ref, 2);
    } else {
        goto slow;
    }
    if (v == st->has_ttl || Py_TYPE(v) == (PyTypeObject *)st->frozen)
        goto slow;
    /* hold what the table held: a write from another thread may replace
       the entry while a tick is taken (it cannot while this runs under the
       GIL, but PyIter_Next could in principle run Python code) */
    Py_INCREF(page);
    Py_INCREF(slot);
    Py_INCREF(v);
    PyObject *pstate = PyObject_GetAttr(page, s_pstate);
    if (pstate == NULL)
        goto fail;
    long ps = PyLong_AsLong(pstate);
    Py_DECREF(pstate);
    if (ps == -1 && PyErr_Occurred())
        goto fail;
    if (ps == st->resident) {
        PyObject *t = hit_tick(st);
        if (t == NULL)
            goto fail;
        int rc = PyObject_SetAttr(page, s_stamp, t);
        Py_DECREF(t);
        if (rc < 0)
            goto fail;
        Py_DECREF(page);
        Py_DECREF(slot);
        return v;
    }
    if (ps == st->slotted) {
        /* policy="midpoint": only a young entry (stamp > 0) is hit here */
        PyObject *stamps = PyObject_GetAttr(page, s_stamps);
        if (stamps == NULL)
            goto fail;
        Py_ssize_t i = PyLong_AsSsize_t(slot);
        if (!PyList_CheckExact(stamps) || i < 0 || i >= PyList_GET_SIZE(stamps)) {
            PyErr_Clear();
            Py_DECREF(stamps);
            goto release_slow;
        }
        PyObject *old = PyList_GET_ITEM(stamps, i);
        long long stamp = PyLong_CheckExact(old) ? PyLong_AsLongLong(old) : 0;
        if (stamp == -1 && PyErr_Occurred())
            PyErr_Clear();
        if (stamp <= 0) {
            Py_DECREF(stamps);
            goto release_slow;
        }
        PyObject *t = hit_tick(st);
        if (t == NULL) {
            Py_DECREF(stamps);
            goto fail;
        }
        int rc = PyList_SetItem(stamps, i, t);  /* steals t */
        Py_DECREF(stamps);
        if (rc < 0)
            goto fail;
        Py_DECREF(page);
        Py_DECREF(slot);
        return v;
    }
release_slow:
    Py_DECREF(page);
    Py_DECREF(slot);
    Py_DECREF(v);
slow:
    return call_slow(st->cache, st->slow, args, (size_t)nargsf, kwnames);
fail:
    Py_DECREF(page);
    Py_DECREF(slot);
    Py_DECREF(v);
    return NULL;
}

static PyMethodDef hit_get_def = {
    "get", (PyCFunction)(void (*)(void))hit_get, METH_FASTCALL | METH_KEYWORDS,
    "get(key, default=None)\n--\n\n"
    "Return the value for key, or default when missing or expired: durablekv.Cache.get,\n"
    "whose memory hit runs in C on an open cache (help(durablekv.Cache.get) has the\n"
    "whole text; patching Cache.get on the class still takes effect).",
};

/* fast.name (a new reference), or NULL with an AttributeError that names
 * the field: ``fast`` is the cache's durablekv.fastpath.FastPath, whose
 * fields the getter and setter take once, at construction. */
static PyObject *
fast_field(PyObject *fast, const char *name)
{
    PyObject *v = PyObject_GetAttrString(fast, name);
    if (v == NULL && PyErr_ExceptionMatches(PyExc_AttributeError)) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "the fast path object lacks the field %s "
                     "(durablekv/fastpath.py defines it)", name);
    }
    return v;
}

/* fast.name as a C long; -1 with an error set. */
static int
fast_long(PyObject *fast, const char *name, long *out)
{
    PyObject *v = fast_field(fast, name);
    if (v == NULL)
        return -1;
    *out = PyLong_AsLong(v);
    Py_DECREF(v);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* Fill a new getter's or setter's state ``st``: *fields[0] = cache, then
 * *fields[i] = fast.<names[i - 1]> (new references); let the collector track
 * it, and return the function ``def`` bound to it (which then holds the only
 * reference). On an error the state is freed and NULL returned. */
static PyObject *
state_function(PyObject *st, PyObject **fields[], const char *const names[], int n,
               PyObject *cache, PyObject *fast, PyMethodDef *def)
{
    for (int i = 0; i < n; i++)
        *fields[i] = NULL;
    PyObject_GC_Track(st);
    Py_INCREF(cache);
    *fields[0] = cache;
    for (int i = 1; i < n; i++) {
        *fields[i] = fast_field(fast, names[i - 1]);
        if (*fields[i] == NULL) {
            Py_DECREF(st);
            return NULL;
        }
    }
    PyObject *fn = PyCFunction_New(def, st);
    Py_DECREF(st);
    return fn;
}

static PyObject *
py_hit_getter(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "hit_getter takes 2 arguments: the cache and its "
                        "fast path (durablekv.fastpath.FastPath)");
        return NULL;
    }
    long resident, slotted;
    if (fast_long(args[1], "resident", &resident) < 0 ||
            fast_long(args[1], "slotted", &slotted) < 0)
        return NULL;
    HitState *st = PyObject_GC_New(HitState, &HitStateType);
    if (st == NULL)
        return NULL;
    st->resident = resident;
    st->slotted = slotted;
    PyObject **fields[] = {&st->cache, &st->table, &st->ticks, &st->open, &st->has_ttl,
                           &st->frozen, &st->slow};
    static const char *const names[] = {"table", "ticks", "open", "has_ttl", "frozen", "get"};
    PyObject *fn = state_function((PyObject *)st, fields, names, 7, args[0], args[1],
                                  &hit_get_def);
    if (fn == NULL)
        return NULL;
    HitState *made = (HitState *)PyCFunction_GET_SELF(fn);
    if (!PyDict_CheckExact(made->table) || !PyType_Check(made->frozen)) {
        Py_DECREF(fn);
        PyErr_SetString(PyExc_TypeError, "hit_getter: the fast path's table must be a dict "
                        "and its frozen a type");
        return NULL;
    }
    return fn;
}

/* ---------------------------------------------------------------- overwrite
 *
 * hot_setter(cache, fast) -> a callable set(key, value) that Cache installs
 * as its instance's ``set`` (durability "log" or "none"): the hot path of
 * Cache.set (durablekv/cache.py) in C, for an overwrite of a live entry in a
 * resident page, with an ASCII str key and a bytes value, the log appending
 * into its mapped segment. ``fast`` is the cache's
 * durablekv.fastpath.FastPath; its fields are read once, here. It checks
 * every condition first, under the cache's lock, and changes nothing unless
 * all hold; then the same steps as the Python hot path, in the same order
 * (the record into the mapping, the LSN, the slot, the entry, the byte
 * counts, the version, the dirty map, the LRU tick, the count). The lock is
 * not kept: each call takes ``cache._lock`` as it is then, as the Python set
 * does (a forked child's lock is a new one). ``fast.monotonic`` is the clock
 * dirty_since is read from (time.monotonic as imported, which clock-faking
 * tests leave alone). Anything else calls ``fast.set``, the Python
 * Cache.set, with the same arguments: it grows or rolls the log, waits for
 * back-pressure, enforces max_memory_bytes, and raises every error.
 */

typedef struct {
    PyObject_HEAD
    PyObject *cache, *tier, *log, *table, *dirty, *ticks, *open, *has_ttl,
             *seam, *slow, *monotonic;
    long resident;
    Py_ssize_t max_key_bytes;
} SetState;

static PyObject *s_pending, *s_max_pending, *s_max_value, *s_page_bytes_limit, *s_max_bytes,
                *s_last_lsn_c, *s_mm, *s_size, *s_segment_bytes, *s_write, *s_last_start,
                *s_last_lsn, *s_values, *s_nbytes, *s_resident_bytes, *s_version,
                *s_dirty_lsn, *s_page_id, *s_locked_ticks, *s_sets, *s_acquire, *s_release,
                *s_dirty_since, *s_flush_batch, *s_batcher, *s_kick, *s_lock,
                *s_failed_after_log;

static int
set_traverse(SetState *self, visitproc visit, void *arg)
{
    Py_VISIT(self->cache); Py_VISIT(self->tier); Py_VISIT(self->log); Py_VISIT(self->table);
    Py_VISIT(self->dirty); Py_VISIT(self->ticks); Py_VISIT(self->open);
    Py_VISIT(self->has_ttl); Py_VISIT(self->seam); Py_VISIT(self->slow);
    Py_VISIT(self->monotonic);
    return 0;
}

static int
set_clear(SetState *self)
{
    Py_CLEAR(self->cache); Py_CLEAR(self->tier); Py_CLEAR(self->log); Py_CLEAR(self->table);
    Py_CLEAR(self->dirty); Py_CLEAR(self->ticks); Py_CLEAR(self->open);
    Py_CLEAR(self->has_ttl); Py_CLEAR(self->seam); Py_CLEAR(self->slow);
    Py_CLEAR(self->monotonic);
    return 0;
}

static void
set_dealloc(SetState *self)
{
    PyObject_GC_UnTrack(self);
    set_clear(self);
    PyObject_GC_Del(self);
}

static PyObject *
set_reduce(SetState *self, PyObject *Py_UNUSED(ignored))
{
    return state_reduce(self->cache);
}

static PyMethodDef set_state_methods[] = {
    {"__reduce__", (PyCFunction)set_reduce, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject SetStateType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "durablekv._native.SetState",
    .tp_basicsize = sizeof(SetState),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_traverse = (traverseproc)set_traverse,
    .tp_clear = (inquiry)set_clear,
    .tp_dealloc = (destructor)set_dealloc,
    .tp_methods = set_state_methods,
};

/* obj.name as a C integer; -1 with an error set when it is not one. */
static int
attr_ssize(PyObject *obj, PyObject *name, Py_ssize_t *out)
{
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL)
        return -1;
    if (!PyLong_CheckExact(v)) {
        Py_DECREF(v);
        PyErr_SetString(PyExc_TypeError, "not an int");
        return -1;
    }
    *out = PyLong_AsSsize_t(v);
    Py_DECREF(v);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* obj.name = value (a C integer); -1 with an error set. */
static int
set_ssize(PyObject *obj, PyObject *name, Py_ssize_t value)
{
    PyObject *v = PyLong_FromSsize_t(value);
    if (v == NULL)
        return -1;
    int rc = PyObject_SetAttr(obj, name, v);
    Py_DECREF(v);
    return rc;
}

/* 1: every condition of the hot path holds and the record is in the log
 * (*was_dirty: whether the page was dirty already; nothing else changed
 * yet); 0: a condition does not hold (nothing changed); -1: an error. The
 * lock is held. */
static int
set_check_and_log(SetState *st, PyObject *key, PyObject *value, PyObject *page, Py_ssize_t nbytes,
                  Py_ssize_t lsn, const char *kdata, Py_ssize_t klen, int *was_dirty)
{
    Py_ssize_t a, b;
    PyObject *v = PyObject_GetAttr(page, s_pstate);
    if (v == NULL)
        return -1;
    long ps = PyLong_AsLong(v);
    Py_DECREF(v);
    if (ps != st->resident)
        return PyErr_Occurred() ? -1 : 0;
    if (attr_ssize(page, s_nbytes, &a) < 0 || attr_ssize(st->tier, s_page_bytes_limit, &b) < 0)
        return -1;
    if (a + nbytes > b)
        return 0;
    v = PyObject_GetAttr(st->tier, s_max_bytes);
    if (v == NULL)
        return -1;
    Py_DECREF(v);
    if (v != Py_None)
        return 0;
    PyObject *pid = PyObject_GetAttr(page, s_page_id);
    if (pid == NULL)
        return -1;
    int in = PyDict_Contains(st->dirty, pid);
    Py_DECREF(pid);
    if (in < 0)
        return -1;
    *was_dirty = in;
    if (st->log == Py_None)
        return 1;
    /* the log: appending into its mapping, no roll due, the write seam
       untouched (fault-injection tests replace it) */
    PyObject *seam = PyObject_GetAttr((PyObject *)Py_TYPE(st->log), s_write);
    if (seam == NULL)
        return -1;
    Py_DECREF(seam);
    if (seam != st->seam)
        return 0;
    if (attr_ssize(st->log, s_size, &a) < 0 || attr_ssize(st->log, s_segment_bytes, &b) < 0)
        return -1;
    if (a >= b)
        return 0;
    PyObject *mm = PyObject_GetAttr(st->log, s_mm);
    if (mm == NULL)
        return -1;
    if (mm == Py_None) {
        Py_DECREF(mm);
        return 0;
    }
    Py_ssize_t vlen = PyBytes_GET_SIZE(value);
    Py_ssize_t size = HSIZE + PSIZE + 5 + klen + 5 + vlen;
    Py_buffer view;
    if (PyObject_GetBuffer(mm, &view, PyBUF_WRITABLE) < 0) {
        Py_DECREF(mm);
        return -1;
    }
    Py_DECREF(mm);
    if (a > view.len || view.len - a < size) {
        PyBuffer_Release(&view);
        return 0;  /* the mapping must grow: the Python path does it */
    }
    /* the key's encoding: b"s" + u32(len) + its UTF-8 (ASCII here) */
    unsigned char kstack[256];
    unsigned char *kb = klen + 5 <= (Py_ssize_t)sizeof kstack ? kstack : PyMem_Malloc((size_t)klen + 5);
    if (kb == NULL) {
        PyBuffer_Release(&view);
        PyErr_NoMemory();
        return -1;
    }
    kb[0] = 's';
    put_u32(kb + 1, (uint32_t)klen);
    memcpy(kb + 5, kdata, (size_t)klen);
    build_record((unsigned char *)view.buf + a, (uint64_t)lsn, 1 /* OP_SET */, no_expiry(),
                 (const char *)kb, klen + 5, PyBytes_AS_STRING(value), vlen, 1);
    if (kb != kstack)
        PyMem_Free(kb);
    PyBuffer_Release(&view);
    if (set_ssize(st->log, s_last_start, a) < 0 || set_ssize(st->log, s_size, a + size) < 0 ||
            set_ssize(st->log, s_last_lsn, lsn) < 0)
        return -2;  /* the record is in the mapping: hot_set fails the cache */
    return 1;
}

/* The page joins the dirty pages: dirty[page_id] = page, its dirty_since
 * (time.monotonic(), as the Python path reads it), and the batcher's kick
 * when the batch is full. */
static int
set_dirty(SetState *st, PyObject *page)
{
    PyObject *pid = PyObject_GetAttr(page, s_page_id);
    if (pid == NULL)
        return -1;
    int rc = PyDict_SetItem(st->dirty, pid, page);
    Py_DECREF(pid);
    if (rc < 0)
        return -1;
    PyObject *now = PyObject_CallNoArgs(st->monotonic);
    if (now == NULL)
        return -1;
    rc = PyObject_SetAttr(page, s_dirty_since, now);
    Py_DECREF(now);
    if (rc < 0)
        return -1;
    Py_ssize_t batch;
    if (attr_ssize(st->cache, s_flush_batch, &batch) < 0)
        return -1;
    if (PyDict_GET_SIZE(st->dirty) == batch) {
        PyObject *batcher = PyObject_GetAttr(st->cache, s_batcher);
        if (batcher == NULL)
            return -1;
        PyObject *r = PyObject_CallMethodNoArgs(batcher, s_kick);
        Py_DECREF(batcher);
        if (r == NULL)
            return -1;
        Py_DECREF(r);
    }
    return 0;
}

/* Add ``delta`` to obj.name. */
static int
add_ssize(PyObject *obj, PyObject *name, Py_ssize_t delta)
{
    Py_ssize_t v;
    if (attr_ssize(obj, name, &v) < 0)
        return -1;
    return set_ssize(obj, name, v + delta);
}

static PyObject *
hot_set(PyObject *self, PyObject *const *args, Py_ssize_t nargsf, PyObject *kwnames)
{
    SetState *st = (SetState *)self;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (st->cache != NULL) {
        int patched;
        PyObject *r = call_patched(st->cache, s_set, st->slow, args, (size_t)nargsf, kwnames,
                                   &patched);
        if (patched)
            return r;
    }
    if (kwnames != NULL || nargs != 2 || st->cache == NULL)
        return call_slow(st->cache, st->slow, args, (size_t)nargsf, kwnames);
    PyObject *key = args[0], *value = args[1];
    if (!PyUnicode_CheckExact(key) || !PyUnicode_IS_ASCII(key) || !PyBytes_CheckExact(value))
        goto slow;
    Py_ssize_t klen = PyUnicode_GET_LENGTH(key);
    if (klen + 5 > st->max_key_bytes)
        goto slow;
    Py_ssize_t maxv;
    if (attr_ssize(st->cache, s_max_value, &maxv) < 0) {
        PyErr_Clear();
        goto slow;
    }
    if (PyBytes_GET_SIZE(value) > maxv)
        goto slow;
    Py_ssize_t nbytes = klen + 5 + PyBytes_GET_SIZE(value) + 5;
    /* the cache's lock as it is now, looked up as the Python set does: a
       forked child's is a new one (Lifecycle._retire_after_fork), and the
       one it replaced may stay held for good by a parent thread */
    PyObject *lock = PyObject_GetAttr(st->cache, s_lock);
    if (lock == NULL)
        return NULL;
    PyObject *r = PyObject_CallMethodNoArgs(lock, s_acquire);
    if (r == NULL) {
        Py_DECREF(lock);
        return NULL;
    }
    Py_DECREF(r);
    int ok = 0;
    int logged = 0;  /* the record is in the log: an error from here fails the cache */
    Py_ssize_t lsn = 0;
    PyObject *ref = NULL;
    PyObject *state = PyObject_GetAttr(st->cache, s_state);
    if (state == NULL)
        goto error;
    Py_DECREF(state);
    if (state != st->open)
        goto release;
    Py_ssize_t pending, maxp;
    if (attr_ssize(st->tier, s_pending, &pending) < 0 ||
            attr_ssize(st->cache, s_max_pending, &maxp) < 0)
        goto error;
    if (pending >= maxp)
        goto release;
    ref = PyDict_GetItemWithError(st->table, key);
    if (ref == NULL) {
        if (PyErr_Occurred())
            goto error;
        goto release;
    }
    Py_INCREF(ref);
    int is_list = PyList_CheckExact(ref);
    if (!(is_list || PyTuple_CheckExact(ref)) || Py_SIZE(ref) != 3)
        goto release;
    PyObject *page = is_list ? PyList_GET_ITEM(ref, 0) : PyTuple_GET_ITEM(ref, 0);
    PyObject *slot = is_list ? PyList_GET_ITEM(ref, 1) : PyTuple_GET_ITEM(ref, 1);
    PyObject *old = is_list ? PyList_GET_ITEM(ref, 2) : PyTuple_GET_ITEM(ref, 2);
    if (old == st->has_ttl)
        goto release;
    PyObject *values = PyObject_GetAttr(page, s_values);
    if (values == NULL)
        goto error;
    Py_ssize_t i = PyLong_AsSsize_t(slot);
    int values_ok = PyList_CheckExact(values) && i >= 0 && i < PyList_GET_SIZE(values);
    PyErr_Clear();
    if (!values_ok) {
        Py_DECREF(values);
        goto release;
    }
    Py_ssize_t last;
    if (attr_ssize(st->cache, s_last_lsn_c, &last) < 0) {
        Py_DECREF(values);
        goto error;
    }
    lsn = last + 1;
    int was_dirty = 0;
    int go = set_check_and_log(st, key, value, page, nbytes, lsn,
                               (const char *)PyUnicode_DATA(key), klen, &was_dirty);
    if (go <= 0) {
        Py_DECREF(values);
        logged = go == -2;
        if (go < 0)
            goto error;
        goto release;
    }
    /* From here on the record is in the log: the steps below must all be
       taken. They fail only on memory exhaustion (or an exception from a
       kick the batcher was given); then the cache fails, as the Python
       path's does (Cache._failed_after_log), so that the LSN is never
       logged again and memory, which did not take the write, serves
       nothing more. */
    logged = 1;
    if (set_ssize(st->cache, s_last_lsn_c, lsn) < 0)
        goto error_values;
    Py_INCREF(value);
    PyList_SetItem(values, i, value);
    Py_DECREF(values);
    if (is_list) {
        Py_INCREF(value);
        PyList_SetItem(ref, 2, value);
    } else {
        PyObject *entry = PyList_New(3);
        if (entry == NULL)
            goto error;
        Py_INCREF(page); PyList_SET_ITEM(entry, 0, page);
        Py_INCREF(slot); PyList_SET_ITEM(entry, 1, slot);
        Py_INCREF(value); PyList_SET_ITEM(entry, 2, value);
        int rc = PyDict_SetItem(st->table, key, entry);
        Py_DECREF(entry);
        if (rc < 0)
            goto error;
    }
    if (add_ssize(page, s_nbytes, nbytes) < 0 || add_ssize(st->tier, s_resident_bytes, nbytes) < 0 ||
            add_ssize(page, s_version, 1) < 0)
        goto error;
    PyObject *dl = PyObject_GetAttr(page, s_dirty_lsn);
    if (dl == NULL)
        goto error;
    Py_DECREF(dl);
    if (dl == Py_None && set_ssize(page, s_dirty_lsn, lsn) < 0)
        goto error;
    if (!was_dirty && set_dirty(st, page) < 0)
        goto error;
    PyObject *t = PyIter_Next(st->ticks);
    if (t == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_RuntimeError, "the LRU clock stopped");
        goto error;
    }
    int rc = PyObject_SetAttr(page, s_stamp, t);
    Py_DECREF(t);
    if (rc < 0 || add_ssize(st->tier, s_locked_ticks, 1) < 0 || add_ssize(st->cache, s_sets, 1) < 0)
        goto error;
    ok = 1;
    goto release;
error_values:
    Py_DECREF(values);
error:
    Py_XDECREF(ref);
    {
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        if (logged) {
            /* (still under the lock) the original error is kept whatever
               this call does */
            PyErr_NormalizeException(&et, &ev, &tb);
            PyObject *n = PyLong_FromSsize_t(lsn);
            PyObject *fr = n == NULL ? NULL : PyObject_CallMethodObjArgs(
                st->cache, s_failed_after_log, n, ev != NULL ? ev : Py_None, NULL);
            Py_XDECREF(n);
            if (fr == NULL)
                PyErr_Clear();
            Py_XDECREF(fr);
        }
        PyObject *rr = PyObject_CallMethodNoArgs(lock, s_release);
        Py_XDECREF(rr);
        PyErr_Restore(et, ev, tb);
    }
    Py_DECREF(lock);
    return NULL;
release:
    Py_XDECREF(ref);
    r = PyObject_CallMethodNoArgs(lock, s_release);
    Py_DECREF(lock);
    if (r == NULL)
        return NULL;
    Py_DECREF(r);
    if (ok)
        Py_RETURN_NONE;
slow:
    {
        PyObject *stack[3] = {st->cache, args[0], args[1]};
        return PyObject_Vectorcall(st->slow, stack, 3, NULL);
    }
}

static PyMethodDef hot_set_def = {
    "set", (PyCFunction)(void (*)(void))hot_set, METH_FASTCALL | METH_KEYWORDS,
    "set(key, value, expire=None, *, tag=None)\n--\n\n"
    "Store value under key: durablekv.Cache.set, whose overwrite of an entry in memory\n"
    "runs in C on an open cache (help(durablekv.Cache.set) has the whole text;\n"
    "patching Cache.set on the class still takes effect).",
};

static PyObject *
py_hot_setter(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "hot_setter takes 2 arguments: the cache and its "
                        "fast path (durablekv.fastpath.FastPath)");
        return NULL;
    }
    long resident, maxk;
    if (fast_long(args[1], "resident", &resident) < 0 ||
            fast_long(args[1], "max_key_bytes", &maxk) < 0)
        return NULL;
    SetState *st = PyObject_GC_New(SetState, &SetStateType);
    if (st == NULL)
        return NULL;
    st->resident = resident;
    st->max_key_bytes = (Py_ssize_t)maxk;
    /* the lock is not kept: each call takes cache._lock (hot_set) */
    PyObject **fields[] = {&st->cache, &st->tier, &st->log, &st->table, &st->dirty, &st->ticks,
                           &st->open, &st->has_ttl, &st->seam, &st->slow, &st->monotonic};
    static const char *const names[] = {"tier", "log", "table", "dirty", "ticks", "open",
                                        "has_ttl", "log_write", "set", "monotonic"};
    PyObject *fn = state_function((PyObject *)st, fields, names, 11, args[0], args[1],
                                  &hot_set_def);
    if (fn == NULL)
        return NULL;
    SetState *made = (SetState *)PyCFunction_GET_SELF(fn);
    if (!PyDict_CheckExact(made->table) || !PyDict_CheckExact(made->dirty) ||
            !PyCallable_Check(made->monotonic)) {
        Py_DECREF(fn);
        PyErr_SetString(PyExc_TypeError, "hot_setter: the fast path's table and dirty map "
                        "must be dicts and its monotonic a clock");
        return NULL;
    }
    return fn;
}

/* --------------------------------------------------- recovery: Records */

/* A Records object is a sequence of parsed, CRC-checked log records that
 * makes no Python object per record until one is asked for: each item is a
 * pointer to the record's header in a bytes object the Records keeps alive
 * (index_segment copies the parsed region of a segment into one). Indexing
 * gives the (lsn, op, key, value, expire_at) tuple parse_segment makes, so
 * code written for a list of tuples reads it unchanged; recovery's bulk
 * steps (reduce, decode_keys, memory_forms, ...) read the bytes in place.
 * Why: at recovery, a tuple, an int and two bytes objects per record, all
 * freed once each key's last record is picked, were about half its time. */

typedef struct {
    PyObject_HEAD
    PyObject *owners;                /* tuple of the bytes objects pointed into */
    const unsigned char **recs;      /* each record's header */
    Py_ssize_t n;
} RecordsObject;

static PyTypeObject Records_Type;

static inline uint64_t rec_lsn(const unsigned char *r) { return get_u64(r + 8); }
static inline unsigned rec_op(const unsigned char *r) { return r[HSIZE]; }
static inline double rec_exp(const unsigned char *r) { return get_f64(r + HSIZE + 1); }
static inline uint32_t rec_klen(const unsigned char *r) { return get_u32(r + HSIZE + 9); }
static inline const unsigned char *rec_key(const unsigned char *r) { return r + HSIZE + PSIZE; }
static inline Py_ssize_t rec_vlen(const unsigned char *r)
{
    return (Py_ssize_t)get_u32(r) - PSIZE - (Py_ssize_t)rec_klen(r);
}
static inline const unsigned char *rec_value(const unsigned char *r) { return rec_key(r) + rec_klen(r); }

/* A new Records of n (uninitialised) items keeping ``owners`` alive. */
static RecordsObject *
records_new(PyObject *owners, Py_ssize_t n)
{
    RecordsObject *self = PyObject_New(RecordsObject, &Records_Type);
    if (self == NULL)
        return NULL;
    self->recs = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(*self->recs));
    if (self->recs == NULL) {
        self->owners = NULL;
        Py_DECREF(self);
        return (RecordsObject *)PyErr_NoMemory();
    }
    Py_INCREF(owners);
    self->owners = owners;
    self->n = n;
    return self;
}

static void
records_dealloc(RecordsObject *self)
{
    PyMem_Free((void *)self->recs);
    Py_XDECREF(self->owners);
    PyObject_Free(self);
}

static Py_ssize_t
records_len(RecordsObject *self)
{
    return self->n;
}

static PyObject *
expire_obj(double exp)
{
    if (isnan(exp))
        Py_RETURN_NONE;
    return PyFloat_FromDouble(exp);
}

/* The record's tuple, as parse_segment makes it. */
static PyObject *
record_tuple(const unsigned char *r)
{
    uint32_t klen = rec_klen(r);
    const char *k = (const char *)rec_key(r);
    return Py_BuildValue("(Kiy#y#N)", (unsigned long long)rec_lsn(r), (int)rec_op(r),
                         k, (Py_ssize_t)klen, k + klen, rec_vlen(r), expire_obj(rec_exp(r)));
}

static PyObject *
records_item(RecordsObject *self, Py_ssize_t i)
{
    if (i < 0 || i >= self->n) {
        PyErr_SetString(PyExc_IndexError, "Records index out of range");
        return NULL;
    }
    return record_tuple(self->recs[i]);
}

static PyObject *
records_subscript(RecordsObject *self, PyObject *item)
{
    if (PyIndex_Check(item)) {
        Py_ssize_t i = PyNumber_AsSsize_t(item, PyExc_IndexError);
        if (i == -1 && PyErr_Occurred())
            return NULL;
        if (i < 0)
            i += self->n;
        return records_item(self, i);
    }
    if (!PySlice_Check(item)) {
        PyErr_Format(PyExc_TypeError, "Records indices must be integers or slices, not %.200s",
                     Py_TYPE(item)->tp_name);
        return NULL;
    }
    Py_ssize_t start, stop, step;
    if (PySlice_Unpack(item, &start, &stop, &step) < 0)
        return NULL;
    Py_ssize_t len = PySlice_AdjustIndices(self->n, &start, &stop, step);
    RecordsObject *out = records_new(self->owners, len);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t j = 0, i = start; j < len; j++, i += step)
        out->recs[j] = self->recs[i];
    return (PyObject *)out;
}

/* index_segment(data, pos) -> (records, pos, stopped): parse_segment, but
 * the records are a Records over a copy of the bytes parsed. */
static PyObject *
py_index_segment(PyObject *Py_UNUSED(self), PyObject *args)
{
    Py_buffer buf;
    Py_ssize_t pos;
    if (!PyArg_ParseTuple(args, "y*n:index_segment", &buf, &pos))
        return NULL;
    const unsigned char *d = buf.buf;
    Py_ssize_t size = buf.len, cap = 1024, n = 0;
    Py_ssize_t *offs = PyMem_Malloc((size_t)cap * sizeof(*offs));
    if (offs == NULL) {
        PyBuffer_Release(&buf);
        return PyErr_NoMemory();
    }
    if (pos < 0)
        pos = 0;
    Py_ssize_t start = pos;
    uint32_t last_n = 0, seed = 0;
    int have_seed = 0, stopped = 0;
    /* the same checks, in the same order, as parse_segment */
    while (pos < size) {
        if (pos + HSIZE > size) { stopped = 1; break; }
        const unsigned char *r = d + pos;
        uint32_t len = get_u32(r), crc = get_u32(r + 4);
        if (len < PSIZE || (uint64_t)len > MAX_RECORD) { stopped = 1; break; }
        Py_ssize_t end = pos + HSIZE + (Py_ssize_t)len;
        if (end > size) { stopped = 1; break; }
        if (!have_seed || len != last_n) {
            seed = crc32_update(0, r, 4);
            last_n = len;
            have_seed = 1;
        }
        if (crc32_update(seed, r + 8, (size_t)len + 8) != crc) { stopped = 1; break; }
        unsigned op = r[HSIZE];
        uint32_t klen = get_u32(r + HSIZE + 9);
        if (op < 1 || op > 3 || (uint64_t)PSIZE + klen > len) { stopped = 1; break; }
        if (n == cap) {
            cap *= 2;
            Py_ssize_t *more = PyMem_Realloc(offs, (size_t)cap * sizeof(*offs));
            if (more == NULL) {
                PyMem_Free(offs);
                PyBuffer_Release(&buf);
                return PyErr_NoMemory();
            }
            offs = more;
        }
        offs[n++] = pos - start;
        pos = end;
    }
    PyObject *copy = PyBytes_FromStringAndSize((const char *)d + start, pos - start);
    PyBuffer_Release(&buf);
    PyObject *owners = copy ? PyTuple_Pack(1, copy) : NULL;
    Py_XDECREF(copy);
    RecordsObject *recs = owners ? records_new(owners, n) : NULL;
    Py_XDECREF(owners);
    if (recs == NULL) {
        PyMem_Free(offs);
        return NULL;
    }
    const unsigned char *base = (const unsigned char *)PyBytes_AS_STRING(copy);
    for (Py_ssize_t i = 0; i < n; i++)
        recs->recs[i] = base + offs[i];
    PyMem_Free(offs);
    return Py_BuildValue("(NnO)", recs, pos, stopped ? Py_True : Py_False);
}

/* Records.join(iterable of Records) -> Records: them all, in order. */
static PyObject *
records_join(PyObject *Py_UNUSED(cls), PyObject *arg)
{
    PyObject *seq = PySequence_Fast(arg, "Records.join needs an iterable of Records");
    if (seq == NULL)
        return NULL;
    Py_ssize_t m = PySequence_Fast_GET_SIZE(seq), total = 0, nown = 0;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t j = 0; j < m; j++) {
        if (!PyObject_TypeCheck(items[j], &Records_Type)) {
            Py_DECREF(seq);
            PyErr_SetString(PyExc_TypeError, "Records.join needs an iterable of Records");
            return NULL;
        }
        total += ((RecordsObject *)items[j])->n;
        nown += PyTuple_GET_SIZE(((RecordsObject *)items[j])->owners);
    }
    PyObject *owners = PyTuple_New(nown);
    if (owners == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    for (Py_ssize_t j = 0, o = 0; j < m; j++) {
        PyObject *own = ((RecordsObject *)items[j])->owners;
        for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(own); k++, o++) {
            Py_INCREF(PyTuple_GET_ITEM(own, k));
            PyTuple_SET_ITEM(owners, o, PyTuple_GET_ITEM(own, k));
        }
    }
    RecordsObject *out = records_new(owners, total);
    Py_DECREF(owners);
    if (out != NULL) {
        Py_ssize_t i = 0;
        for (Py_ssize_t j = 0; j < m; j++) {
            RecordsObject *r = (RecordsObject *)items[j];
            memcpy((void *)(out->recs + i), r->recs, (size_t)r->n * sizeof(*r->recs));
            i += r->n;
        }
    }
    Py_DECREF(seq);
    return (PyObject *)out;
}

/* lsns_step_by_one() -> bool: each LSN is the one before it plus one. */
static PyObject *
records_lsns_step_by_one(RecordsObject *self, PyObject *Py_UNUSED(ignored))
{
    for (Py_ssize_t i = 1; i < self->n; i++)
        if (rec_lsn(self->recs[i]) != rec_lsn(self->recs[i - 1]) + 1)
            Py_RETURN_FALSE;
    Py_RETURN_TRUE;
}

/* A 64-bit hash of a key's bytes (FNV-1a, 8 bytes a step, then a
 * murmur3 finaliser so that the low bits the table uses are mixed). */
static inline uint64_t
key_hash(const unsigned char *p, size_t n)
{
    uint64_t h = 0xcbf29ce484222325ull ^ n;
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        h = (h ^ w) * 0x100000001b3ull;
        h ^= h >> 29;
        p += 8;
        n -= 8;
    }
    while (n--)
        h = (h ^ *p++) * 0x100000001b3ull;
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ull;
    h ^= h >> 33;
    return h;
}

typedef struct {
    uint64_t hash;
    Py_ssize_t last;     /* index of the key's last record */
    int deleted;         /* a delete of the key was seen */
} key_entry;

/* reduce() -> (finals, first, fresh, has_deletes)
 *
 * What recovery's _replay works out from a list of records (in LSN order):
 * ``first``, the position after the last clear (0 when there is none); of
 * the records from there on, ``finals``: each key's last record, keyed by its
 * logged bytes, in LSN order (a Records); ``fresh``: the positions in
 * ``finals`` of keys with a delete among those records; ``has_deletes``:
 * whether there is a delete among them at all. */
static PyObject *
records_reduce(RecordsObject *self, PyObject *Py_UNUSED(ignored))
{
    Py_ssize_t n = self->n, first = 0;
    for (Py_ssize_t i = n - 1; i >= 0; i--)
        if (rec_op(self->recs[i]) == 3) {
            first = i + 1;
            break;
        }
    Py_ssize_t m = n - first, cap = 16;
    while (cap < 2 * m)
        cap <<= 1;
    Py_ssize_t *slots = PyMem_Malloc((size_t)cap * sizeof(*slots));
    key_entry *entries = PyMem_Malloc((size_t)(m ? m : 1) * sizeof(*entries));
    Py_ssize_t *last_of = PyMem_Malloc((size_t)(m ? m : 1) * sizeof(*last_of));
    PyObject *fresh = NULL, *result = NULL;
    RecordsObject *finals = NULL;
    if (slots == NULL || entries == NULL || last_of == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    memset(slots, 0xFF, (size_t)cap * sizeof(*slots));   /* -1: empty */
    Py_ssize_t nkeys = 0, nfinal = 0;
    int has_deletes = 0;
    size_t mask = (size_t)cap - 1;
    for (Py_ssize_t j = 0; j < m; j++) {
        const unsigned char *r = self->recs[first + j];
        const unsigned char *k = rec_key(r);
        uint32_t klen = rec_klen(r);
        uint64_t h = key_hash(k, klen);
        size_t s = (size_t)h & mask;
        Py_ssize_t e;
        for (;;) {
            e = slots[s];
            if (e < 0) {
                e = slots[s] = nkeys++;
                entries[e].hash = h;
                entries[e].last = -1;
                entries[e].deleted = 0;
                break;
            }
            if (entries[e].hash == h) {
                const unsigned char *o = self->recs[first + entries[e].last];
                if (rec_klen(o) == klen && memcmp(rec_key(o), k, klen) == 0)
                    break;
            }
            s = (s + 1) & mask;
        }
        if (entries[e].last >= 0)
            last_of[entries[e].last] = -1;
        else
            nfinal++;
        entries[e].last = j;
        last_of[j] = e;
        if (rec_op(r) == 2) {
            entries[e].deleted = 1;
            has_deletes = 1;
        }
    }
    finals = records_new(self->owners, nfinal);
    fresh = PyList_New(0);
    if (finals == NULL || fresh == NULL)
        goto done;
    for (Py_ssize_t j = 0, f = 0; j < m; j++) {
        if (last_of[j] < 0)
            continue;
        if (entries[last_of[j]].deleted) {
            PyObject *ix = PyLong_FromSsize_t(f);
            if (ix == NULL || PyList_Append(fresh, ix) < 0) {
                Py_XDECREF(ix);
                goto done;
            }
            Py_DECREF(ix);
        }
        finals->recs[f++] = self->recs[first + j];
    }
    result = Py_BuildValue("(OnOO)", finals, first, fresh,
                           has_deletes ? Py_True : Py_False);
done:
    PyMem_Free(slots);
    PyMem_Free(entries);
    PyMem_Free(last_of);
    Py_XDECREF(finals);
    Py_XDECREF(fresh);
    return result;
}

/* take(indices) -> Records: the items at those positions, in that order. */
static PyObject *
records_take(RecordsObject *self, PyObject *arg)
{
    /* a tuple of its own, not PySequence_Fast (the list itself): an item's
       __index__ may change the list, which would free the items read here */
    PyObject *seq = PySequence_Tuple(arg);
    if (seq == NULL)
        return NULL;
    Py_ssize_t m = PyTuple_GET_SIZE(seq);
    PyObject **items = &PyTuple_GET_ITEM(seq, 0);
    RecordsObject *out = records_new(self->owners, m);
    if (out == NULL)
        goto fail;
    for (Py_ssize_t j = 0; j < m; j++) {
        Py_ssize_t i = PyNumber_AsSsize_t(items[j], PyExc_IndexError);
        if (i == -1 && PyErr_Occurred())
            goto fail;
        if (i < 0)
            i += self->n;
        if (i < 0 || i >= self->n) {
            PyErr_SetString(PyExc_IndexError, "Records index out of range");
            goto fail;
        }
        out->recs[j] = self->recs[i];
    }
    Py_DECREF(seq);
    return (PyObject *)out;
fail:
    Py_DECREF(seq);
    Py_XDECREF(out);
    return NULL;
}

/* decode_keys(decode_key) -> (keys, others): codec.decode_keys of the
 * records' keys; str and int64 keys decoded here, any other by decode_key. */
static PyObject *
records_decode_keys(RecordsObject *self, PyObject *slow)
{
    Py_ssize_t n = self->n;
    PyObject *keys = PyList_New(n), *others = PyList_New(0);
    if (keys == NULL || others == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        const unsigned char *p = rec_key(self->recs[i]);
        Py_ssize_t len = rec_klen(self->recs[i]);
        PyObject *key = NULL;
        int other = 0;
        if (len >= 5 && p[0] == 's' && (Py_ssize_t)get_u32(p + 1) == len - 5) {
            key = PyUnicode_DecodeUTF8((const char *)p + 5, len - 5, "surrogatepass");
            if (key == NULL)
                goto fail;
        } else if (len == 9 && p[0] == 'q') {
            key = PyLong_FromLongLong((long long)get_u64(p + 1));
            if (key == NULL)
                goto fail;
            other = 1;
        } else {
            PyObject *b = PyBytes_FromStringAndSize((const char *)p, len);
            if (b == NULL)
                goto fail;
            key = PyObject_CallOneArg(slow, b);
            Py_DECREF(b);
            if (key == NULL)
                goto fail;
            other = !PyBytes_CheckExact(key) && !PyUnicode_CheckExact(key);
        }
        PyList_SET_ITEM(keys, i, key);
        if (other) {
            PyObject *ix = PyLong_FromSsize_t(i);
            if (ix == NULL || PyList_Append(others, ix) < 0) {
                Py_XDECREF(ix);
                goto fail;
            }
            Py_DECREF(ix);
        }
    }
    return Py_BuildValue("(NN)", keys, others);
fail:
    Py_XDECREF(keys);
    Py_XDECREF(others);
    return NULL;
}

/* memory_forms(slow) -> list: memory_forms of the records' values. */
static PyObject *
records_memory_forms(RecordsObject *self, PyObject *slow)
{
    Py_ssize_t n = self->n;
    PyObject *out = PyList_New(n);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        const unsigned char *p = rec_value(self->recs[i]);
        Py_ssize_t len = rec_vlen(self->recs[i]);
        PyObject *v;
        if (len >= 5 && p[0] == 'b' && (Py_ssize_t)get_u32(p + 1) == len - 5) {
            v = PyBytes_FromStringAndSize((const char *)p + 5, len - 5);
        } else {
            PyObject *b = PyBytes_FromStringAndSize((const char *)p, len);
            v = b ? PyObject_CallOneArg(slow, b) : NULL;
            Py_XDECREF(b);
        }
        if (v == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, v);
    }
    return out;
}

/* column(name) -> list: one field of every record: "lsn", "op", "key"
 * (bytes), "value" (bytes), "expire_at" (float or None), or "nbytes" (key
 * and value lengths added: an entry's encoded size). */
static PyObject *
records_column(RecordsObject *self, PyObject *arg)
{
    const char *name = PyUnicode_Check(arg) ? PyUnicode_AsUTF8(arg) : NULL;
    int which = !name ? -1 : !strcmp(name, "lsn") ? 0 : !strcmp(name, "op") ? 1 :
                !strcmp(name, "key") ? 2 : !strcmp(name, "value") ? 3 :
                !strcmp(name, "expire_at") ? 4 : !strcmp(name, "nbytes") ? 5 : -1;
    if (which < 0) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_ValueError, "no column %R", arg);
        return NULL;
    }
    PyObject *out = PyList_New(self->n);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < self->n; i++) {
        const unsigned char *r = self->recs[i];
        PyObject *o;
        switch (which) {
        case 0: o = PyLong_FromUnsignedLongLong(rec_lsn(r)); break;
        case 1: o = PyLong_FromLong(rec_op(r)); break;
        case 2: o = PyBytes_FromStringAndSize((const char *)rec_key(r), rec_klen(r)); break;
        case 3: o = PyBytes_FromStringAndSize((const char *)rec_value(r), rec_vlen(r)); break;
        case 4: o = expire_obj(rec_exp(r)); break;
        default: o = PyLong_FromSsize_t((Py_ssize_t)rec_klen(r) + rec_vlen(r)); break;
        }
        if (o == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, o);
    }
    return out;
}

static PyMethodDef records_methods[] = {
    {"join", (PyCFunction)records_join, METH_O | METH_CLASS,
     "Records.join(iterable of Records) -> Records: them all, in order."},
    {"lsns_step_by_one", (PyCFunction)records_lsns_step_by_one, METH_NOARGS,
     "lsns_step_by_one() -> bool: each LSN is the one before it plus one."},
    {"reduce", (PyCFunction)records_reduce, METH_NOARGS,
     "reduce() -> (finals, first, fresh, has_deletes): each key's last record "
     "after the last clear, in LSN order (see _native.c)."},
    {"take", (PyCFunction)records_take, METH_O,
     "take(indices) -> Records: the items at those positions."},
    {"decode_keys", (PyCFunction)records_decode_keys, METH_O,
     "decode_keys(decode_key) -> (keys, others): codec.decode_keys of the keys."},
    {"memory_forms", (PyCFunction)records_memory_forms, METH_O,
     "memory_forms(slow) -> list: memory forms of the values (bytes unwrapped)."},
    {"column", (PyCFunction)records_column, METH_O,
     "column(name) -> list: lsn, op, key, value, expire_at or nbytes of each record."},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods records_as_sequence = {
    .sq_length = (lenfunc)records_len,
    .sq_item = (ssizeargfunc)records_item,
};

static PyMappingMethods records_as_mapping = {
    .mp_length = (lenfunc)records_len,
    .mp_subscript = (binaryfunc)records_subscript,
};

static PyTypeObject Records_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "durablekv._native.Records",
    .tp_basicsize = sizeof(RecordsObject),
    .tp_dealloc = (destructor)records_dealloc,
    .tp_as_sequence = &records_as_sequence,
    .tp_as_mapping = &records_as_mapping,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Parsed replay-log records, read in place: items are (lsn, op, key, value, "
              "expire_at) tuples made on access (see index_segment).",
    .tp_methods = records_methods,
};

/* ---------------------------------------------------------------- module */

static PyMethodDef methods[] = {
    {"crc32", py_crc32, METH_VARARGS, "crc32(data, seed=0) -> int: zlib.crc32."},
    {"hit_getter", (PyCFunction)(void (*)(void))py_hit_getter, METH_FASTCALL,
     "hit_getter(cache, fast) -> get(key, default=None): Cache.get's memory hit in C, else "
     "fast.get(cache, ...); fast is the cache's durablekv.fastpath.FastPath."},
    {"hot_setter", (PyCFunction)(void (*)(void))py_hot_setter, METH_FASTCALL,
     "hot_setter(cache, fast) -> set(key, value): Cache.set's overwrite of a resident entry "
     "in C, else fast.set(cache, ...); fast is the cache's durablekv.fastpath.FastPath."},
    {"encode_record", (PyCFunction)(void (*)(void))py_encode_record, METH_FASTCALL,
     "encode_record(lsn, op, key, value, expire_at) -> bytes: one replay-log record."},
    {"write_record", (PyCFunction)(void (*)(void))py_write_record, METH_FASTCALL,
     "write_record(fd, lsn, op, key, value, expire_at) -> (written, size): build one "
     "record and write it with one write(2); OSError as os.write."},
    {"store_record", (PyCFunction)(void (*)(void))py_store_record, METH_FASTCALL,
     "store_record(buf, offset, lsn, op, key, value, expire_at) -> size: build one "
     "record into a writable buffer at offset (minus its size when it does not fit)."},
    {"store_bytes_record", (PyCFunction)(void (*)(void))py_store_bytes_record, METH_FASTCALL,
     "store_bytes_record(buf, offset, lsn, op, key, raw, expire_at) -> size: "
     "store_record of the value b'b' + u32(len(raw)) + raw."},
    {"write_bytes_record", (PyCFunction)(void (*)(void))py_write_bytes_record, METH_FASTCALL,
     "write_bytes_record(fd, lsn, op, key, raw, expire_at) -> (written, size): "
     "write_record of the value b'b' + u32(len(raw)) + raw."},
    {"parse_segment", py_parse_segment, METH_VARARGS,
     "parse_segment(data, pos) -> (records, pos, stopped)."},
    {"decode_keys", py_decode_keys, METH_VARARGS,
     "decode_keys(blobs, decode_key) -> (keys, others)."},
    {"memory_forms", py_memory_forms, METH_VARARGS,
     "memory_forms(blobs, slow) -> list of memory forms (bytes values unwrapped)."},
    {"index_segment", py_index_segment, METH_VARARGS,
     "index_segment(data, pos) -> (Records, pos, stopped): parse_segment without a "
     "Python object per record."},
    {"page_columns", py_page_columns, METH_O,
     "page_columns(blob) -> (slots, expires, flags, keys, values), or None when the "
     "Python code must decide."},
    {"encode_columns", (PyCFunction)(void (*)(void))py_encode_columns, METH_FASTCALL,
     "encode_columns(slots, kbs, vbs, expires, flags) -> bytes, or None when the "
     "Python code must decide."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "durablekv._native",
    "C kernels for the replay log, page blobs and the memory hit (see durablekv._accel).", -1,
    methods,
};

PyMODINIT_FUNC
PyInit__native(void)
{
    crc_init();
    if (PyType_Ready(&HitStateType) < 0 || PyType_Ready(&SetStateType) < 0 ||
            PyType_Ready(&Records_Type) < 0)
        return NULL;
#define INTERN(var, text) if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL
    INTERN(s_pending, "pending"); INTERN(s_max_pending, "max_pending_pages");
    INTERN(s_max_value, "max_value_bytes"); INTERN(s_page_bytes_limit, "page_bytes_limit");
    INTERN(s_max_bytes, "max_bytes"); INTERN(s_last_lsn_c, "_last_lsn"); INTERN(s_mm, "_mm");
    INTERN(s_size, "_size"); INTERN(s_segment_bytes, "segment_bytes"); INTERN(s_write, "_write");
    INTERN(s_last_start, "_last_start"); INTERN(s_last_lsn, "_last_lsn");
    INTERN(s_values, "values"); INTERN(s_nbytes, "nbytes");
    INTERN(s_resident_bytes, "resident_bytes"); INTERN(s_version, "version");
    INTERN(s_dirty_lsn, "dirty_lsn"); INTERN(s_page_id, "page_id");
    INTERN(s_locked_ticks, "locked_ticks"); INTERN(s_sets, "_sets");
    INTERN(s_acquire, "acquire"); INTERN(s_release, "release");
    INTERN(s_dirty_since, "dirty_since"); INTERN(s_flush_batch, "flush_batch_pages");
    INTERN(s_batcher, "_batcher"); INTERN(s_kick, "kick"); INTERN(s_lock, "_lock");
    INTERN(s_failed_after_log, "_failed_after_log");
#undef INTERN
    s_state = PyUnicode_InternFromString("_state");
    s_pstate = PyUnicode_InternFromString("state");
    s_stamp = PyUnicode_InternFromString("stamp");
    s_stamps = PyUnicode_InternFromString("stamps");
    s_get = PyUnicode_InternFromString("get");
    s_set = PyUnicode_InternFromString("set");
    s_reduce_ex = PyUnicode_InternFromString("__reduce_ex__");
    if (!s_state || !s_pstate || !s_stamp || !s_stamps || !s_get || !s_set || !s_reduce_ex)
        return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (m == NULL)
        return NULL;
    Py_INCREF(&Records_Type);
    if (PyModule_AddObject(m, "Records", (PyObject *)&Records_Type) < 0) {
        Py_DECREF(&Records_Type);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
