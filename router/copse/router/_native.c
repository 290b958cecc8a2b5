/* The routing decision's inner loops, compiled: the prefix index, the blocks in use, and the
 * per-worker arithmetic.
 *
 * Table: u64 key -> `words` u64 value words, open addressing with linear probing and
 * backward-shift deletion (no tombstones). An entry is its key followed by its value (one cache
 * line to look a block up) and is empty when its value is zero: nothing zero is stored.
 *
 * BlockIndex: block hash -> bitmask of the worker slots holding that block (the value is as many
 * words as the highest slot seen needs). BlockRefs: (worker slot, block hash) -> the number of
 * in-flight requests using that block there, keyed by the hash mixed with the slot (a bijection
 * per slot; across slots two pairs collide as rarely as two 64-bit block hashes do).
 *
 * ttft_ms and lowest: the arithmetic of copse.router.policies over every worker slot, operation
 * for operation as the numpy formulation it replaces (same IEEE double results; built with
 * -ffp-contract=off so that no multiply-add is fused).
 *
 * Everything here runs under the GIL and keeps no Python references, so it needs no GC support.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <string.h>

/* Highest worker slot accepted: index masks are as wide as the highest slot seen, so a stray huge
 * slot number would cost memory for every block. */
#define MAX_SLOTS (1 << 16)
#define INITIAL_CAPACITY 1024

static uint64_t mix(uint64_t x)
{
    /* splitmix64's finaliser: test and synthetic hashes are small integers, not random bits. */
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    x ^= x >> 31;
    return x;
}

typedef struct {
    uint64_t *entries; /* cap entries of 1 + words: key, value */
    size_t cap;        /* a power of two */
    size_t count;
    size_t words;
} Table;

static uint64_t *table_entry(const Table *t, size_t i)
{
    return t->entries + i * (1 + t->words);
}

static uint64_t *table_value(const Table *t, size_t i)
{
    return table_entry(t, i) + 1;
}

static int table_empty_at(const Table *t, size_t i)
{
    const uint64_t *value = table_value(t, i);
    for (size_t w = 0; w < t->words; w++) {
        if (value[w])
            return 0;
    }
    return 1;
}

static size_t table_home(const Table *t, uint64_t key)
{
    return mix(key) & (t->cap - 1);
}

/* Position of `key`, or -1. */
static Py_ssize_t table_find(const Table *t, uint64_t key)
{
    size_t m = t->cap - 1;
    for (size_t i = table_home(t, key);; i = (i + 1) & m) {
        if (table_empty_at(t, i))
            return -1;
        if (*table_entry(t, i) == key)
            return (Py_ssize_t)i;
    }
}

/* Re-lay the table at `cap` entries of `words` value words (values keep their low words). */
static int table_resize(Table *t, size_t cap, size_t words)
{
    Table grown = {.entries = PyMem_Calloc(cap * (1 + words), sizeof(uint64_t)),
                   .cap = cap,
                   .count = t->count,
                   .words = words};
    if (!grown.entries) {
        PyErr_NoMemory();
        return -1;
    }
    size_t m = cap - 1;
    for (size_t i = 0; i < t->cap; i++) {
        if (table_empty_at(t, i))
            continue;
        uint64_t key = *table_entry(t, i);
        size_t j = table_home(&grown, key);
        while (!table_empty_at(&grown, j))
            j = (j + 1) & m;
        *table_entry(&grown, j) = key;
        memcpy(table_value(&grown, j), table_value(t, i), (t->words < words ? t->words : words) * sizeof(uint64_t));
    }
    PyMem_Free(t->entries);
    *t = grown;
    return 0;
}

static int table_init(Table *t, size_t words)
{
    PyMem_Free(t->entries);
    *t = (Table){.entries = NULL, .cap = 0, .count = 0, .words = words};
    return table_resize(t, INITIAL_CAPACITY, words);
}

/* Position of `key`, inserted with a zero value if absent (the caller makes it non-zero at once). */
static Py_ssize_t table_find_or_insert(Table *t, uint64_t key)
{
    if (2 * (t->count + 1) > t->cap && table_resize(t, 2 * t->cap, t->words) < 0)
        return -1;
    size_t m = t->cap - 1;
    for (size_t i = table_home(t, key);; i = (i + 1) & m) {
        if (table_empty_at(t, i)) {
            *table_entry(t, i) = key;
            t->count++;
            return (Py_ssize_t)i;
        }
        if (*table_entry(t, i) == key)
            return (Py_ssize_t)i;
    }
}

/* Remove the entry at `i` (its value already zero), shifting later entries of its cluster back. */
static void table_delete_at(Table *t, size_t i)
{
    size_t m = t->cap - 1, j = i;
    while (1) {
        j = (j + 1) & m;
        if (table_empty_at(t, j))
            break;
        size_t home = table_home(t, *table_entry(t, j));
        /* The entry at j may fill the hole at i unless its home lies cyclically in (i, j]. */
        int stays = i <= j ? (i < home && home <= j) : (i < home || home <= j);
        if (stays)
            continue;
        memcpy(table_entry(t, i), table_entry(t, j), (1 + t->words) * sizeof(uint64_t));
        memset(table_value(t, j), 0, t->words * sizeof(uint64_t));
        i = j;
    }
    t->count--;
}

static int read_u64(PyObject *item, uint64_t *out)
{
    if (PyLong_CheckExact(item)) {
        *out = PyLong_AsUnsignedLongLong(item);
    } else {
        PyObject *number = PyNumber_Index(item);
        if (!number)
            return -1;
        *out = PyLong_AsUnsignedLongLong(number);
        Py_DECREF(number);
    }
    if (*out == (uint64_t)-1 && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "block hash %R is not an unsigned 64-bit integer", item);
        }
        return -1;
    }
    return 0;
}

static int read_slot(PyObject *arg, Py_ssize_t *slot)
{
    *slot = PyLong_AsSsize_t(arg);
    if (*slot == -1 && PyErr_Occurred())
        return -1;
    if (*slot < 0 || *slot >= MAX_SLOTS) {
        PyErr_Format(PyExc_ValueError, "worker slot %zd is outside 0 .. %d", *slot, MAX_SLOTS - 1);
        return -1;
    }
    return 0;
}

/* A C-contiguous float64 vector argument. */
static int get_vector(PyObject *obj, Py_buffer *view, const char *name, int writable)
{
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0)
        return -1;
    if (view->ndim != 1 || view->itemsize != sizeof(double) || !view->format || strcmp(view->format, "d") != 0) {
        PyErr_Format(PyExc_TypeError, "%s must be a contiguous 1-d float64 array", name);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* Apply `step(object, slot, hash)` to every block hash of the iterable args[1] for slot args[0];
 * returns the sum of what the steps returned (each returns a count, or -1 on error). */
typedef Py_ssize_t (*block_step)(void *, Py_ssize_t, uint64_t);

static PyObject *for_each_block(void *self, PyObject *const *args, Py_ssize_t nargs, const char *name,
                                block_step step)
{
    Py_ssize_t slot, total = 0;
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "%s() takes a slot and an iterable of block hashes", name);
        return NULL;
    }
    if (read_slot(args[0], &slot) < 0)
        return NULL;
    PyObject *iterator = PyObject_GetIter(args[1]);
    if (!iterator)
        return NULL;
    PyObject *item;
    while ((item = PyIter_Next(iterator))) {
        uint64_t key;
        Py_ssize_t done = read_u64(item, &key) < 0 ? -1 : step(self, slot, key);
        Py_DECREF(item);
        if (done < 0) {
            Py_DECREF(iterator);
            return NULL;
        }
        total += done;
    }
    Py_DECREF(iterator);
    if (PyErr_Occurred())
        return NULL;
    return PyLong_FromSsize_t(total);
}

/* ---- BlockIndex ------------------------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    Table table;       /* value: bitmask of slots */
    Py_ssize_t *held;  /* blocks held per slot, table.words * 64 entries */
} BlockIndexObject;

static int BlockIndex_init(BlockIndexObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, ":BlockIndex", kwlist))
        return -1;
    PyMem_Free(self->held);
    self->held = PyMem_Calloc(64, sizeof(Py_ssize_t));
    if (!self->held) {
        PyErr_NoMemory();
        return -1;
    }
    return table_init(&self->table, 1);
}

static void BlockIndex_dealloc(BlockIndexObject *self)
{
    PyMem_Free(self->table.entries);
    PyMem_Free(self->held);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int ensure_slot(BlockIndexObject *self, Py_ssize_t slot)
{
    size_t words = (size_t)slot / 64 + 1, old = self->table.words;
    if (words <= old)
        return 0;
    Py_ssize_t *held = PyMem_Calloc(words * 64, sizeof(Py_ssize_t));
    if (!held) {
        PyErr_NoMemory();
        return -1;
    }
    if (table_resize(&self->table, self->table.cap, words) < 0) {
        PyMem_Free(held);
        return -1;
    }
    memcpy(held, self->held, old * 64 * sizeof(Py_ssize_t));
    PyMem_Free(self->held);
    self->held = held;
    return 0;
}

static Py_ssize_t store_one(void *object, Py_ssize_t slot, uint64_t key)
{
    BlockIndexObject *self = object;
    if (ensure_slot(self, slot) < 0)
        return -1;
    Py_ssize_t i = table_find_or_insert(&self->table, key);
    if (i < 0)
        return -1;
    uint64_t *word = table_value(&self->table, (size_t)i) + (size_t)slot / 64;
    uint64_t bit = (uint64_t)1 << (slot % 64);
    if (*word & bit)
        return 0;
    *word |= bit;
    self->held[slot]++;
    return 1;
}

static Py_ssize_t remove_one(void *object, Py_ssize_t slot, uint64_t key)
{
    BlockIndexObject *self = object;
    Table *t = &self->table;
    if ((size_t)slot >= t->words * 64)
        return 0;
    Py_ssize_t i = table_find(t, key);
    if (i < 0)
        return 0;
    uint64_t *word = table_value(t, (size_t)i) + (size_t)slot / 64;
    uint64_t bit = (uint64_t)1 << (slot % 64);
    if (!(*word & bit))
        return 0;
    *word &= ~bit;
    self->held[slot]--;
    if (table_empty_at(t, (size_t)i))
        table_delete_at(t, (size_t)i);
    return 1;
}

static PyObject *BlockIndex_store(BlockIndexObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    return for_each_block(self, args, nargs, "store", store_one);
}

static PyObject *BlockIndex_remove(BlockIndexObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    return for_each_block(self, args, nargs, "remove", remove_one);
}

static PyObject *BlockIndex_clear(BlockIndexObject *self, PyObject *arg)
{
    Py_ssize_t slot;
    Table *t = &self->table;
    if (read_slot(arg, &slot) < 0)
        return NULL;
    if ((size_t)slot >= t->words * 64 || !self->held[slot])
        Py_RETURN_NONE;
    /* Rare (a worker reset or left): drop the slot's bit everywhere, then re-lay the table, since
     * the entries emptied are holes inside clusters. */
    size_t w = (size_t)slot / 64;
    uint64_t keep = ~((uint64_t)1 << (slot % 64));
    for (size_t i = 0; i < t->cap; i++) {
        if (!table_empty_at(t, i)) {
            table_value(t, i)[w] &= keep;
            t->count -= table_empty_at(t, i);
        }
    }
    self->held[slot] = 0;
    if (table_resize(t, t->cap, t->words) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *BlockIndex_holds(BlockIndexObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t slot;
    uint64_t key;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "holds() takes a slot and a block hash");
        return NULL;
    }
    if (read_slot(args[0], &slot) < 0 || read_u64(args[1], &key) < 0)
        return NULL;
    if ((size_t)slot >= self->table.words * 64)
        Py_RETURN_FALSE;
    Py_ssize_t i = table_find(&self->table, key);
    if (i < 0)
        Py_RETURN_FALSE;
    return PyBool_FromLong((long)(table_value(&self->table, (size_t)i)[slot / 64] >> (slot % 64) & 1));
}

static PyObject *BlockIndex_blocks_held(BlockIndexObject *self, PyObject *arg)
{
    Py_ssize_t slot;
    if (read_slot(arg, &slot) < 0)
        return NULL;
    return PyLong_FromSsize_t((size_t)slot < self->table.words * 64 ? self->held[slot] : 0);
}

static PyObject *BlockIndex_leading_blocks(BlockIndexObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "leading_blocks() takes block hashes and an output array");
        return NULL;
    }
    Py_buffer out;
    if (get_vector(args[1], &out, "out", 1) < 0)
        return NULL;
    PyObject *hashes = PySequence_Fast(args[0], "block hashes must be a sequence");
    if (!hashes) {
        PyBuffer_Release(&out);
        return NULL;
    }
    const Table *t = &self->table;
    double *depth = out.buf;
    size_t size = (size_t)(out.len / (Py_ssize_t)sizeof(double));
    size_t words = t->words;
    memset(depth, 0, size * sizeof(double));
    /* Slots still holding every block so far; slots beyond the output are not asked about. */
    uint64_t active[words];
    int any = 0;
    for (size_t w = 0; w < words; w++) {
        size_t first = w * 64;
        active[w] = first >= size ? 0 : size - first >= 64 ? ~(uint64_t)0 : ((uint64_t)1 << (size - first)) - 1;
        any |= active[w] != 0;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(hashes);
    PyObject **items = PySequence_Fast_ITEMS(hashes);
    /* The look-ups miss the cache (the table is megabytes): convert a batch of hashes and prefetch
     * their home entries so that the misses overlap, then walk the batch. */
    enum { BATCH = 32 };
    uint64_t keys[BATCH];
    Py_ssize_t d = 0;
    while (d < n && any) {
        Py_ssize_t batch = n - d < BATCH ? n - d : BATCH;
        for (Py_ssize_t k = 0; k < batch; k++) {
            if (read_u64(items[d + k], &keys[k]) < 0) {
                Py_DECREF(hashes);
                PyBuffer_Release(&out);
                return NULL;
            }
            __builtin_prefetch(table_entry(t, table_home(t, keys[k])));
        }
        for (Py_ssize_t k = 0; k < batch && any; k++, d++) {
            Py_ssize_t i = table_find(t, keys[k]);
            const uint64_t *held = i < 0 ? NULL : table_value(t, (size_t)i);
            any = 0;
            for (size_t w = 0; w < words; w++) {
                uint64_t kept = held ? active[w] & held[w] : 0;
                uint64_t dropped = active[w] & ~kept;
                while (dropped) {
                    depth[w * 64 + (size_t)__builtin_ctzll(dropped)] = (double)d;
                    dropped &= dropped - 1;
                }
                active[w] = kept;
                any |= kept != 0;
            }
        }
    }
    for (size_t w = 0; w < words; w++) {
        for (uint64_t rest = active[w]; rest; rest &= rest - 1)
            depth[w * 64 + (size_t)__builtin_ctzll(rest)] = (double)n;
    }
    Py_DECREF(hashes);
    PyBuffer_Release(&out);
    Py_RETURN_NONE;
}

static Py_ssize_t BlockIndex_len(BlockIndexObject *self)
{
    return (Py_ssize_t)self->table.count;
}

static PyObject *BlockIndex_slot_limit(BlockIndexObject *self, void *closure)
{
    (void)closure;
    return PyLong_FromSize_t(self->table.words * 64);
}

static PyMethodDef BlockIndex_methods[] = {
    {"store", (PyCFunction)(void (*)(void))BlockIndex_store, METH_FASTCALL,
     "store(slot, hashes) -> int: the slot now holds every block in hashes; returns how many it did not hold."},
    {"remove", (PyCFunction)(void (*)(void))BlockIndex_remove, METH_FASTCALL,
     "remove(slot, hashes) -> int: the slot no longer holds these blocks (unknown ones are ignored); "
     "returns how many it held."},
    {"clear", (PyCFunction)BlockIndex_clear, METH_O, "clear(slot): forget every block of the slot."},
    {"holds", (PyCFunction)(void (*)(void))BlockIndex_holds, METH_FASTCALL,
     "holds(slot, block): whether the slot holds the block."},
    {"blocks_held", (PyCFunction)BlockIndex_blocks_held, METH_O, "blocks_held(slot): blocks the slot holds."},
    {"leading_blocks", (PyCFunction)(void (*)(void))BlockIndex_leading_blocks, METH_FASTCALL,
     "leading_blocks(hashes, out): out[slot] = leading blocks of hashes the slot holds, for every slot "
     "below len(out)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef BlockIndex_getset[] = {
    {"slot_limit", (getter)BlockIndex_slot_limit, NULL, "One more than the highest slot a block could be held by.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods BlockIndex_as_sequence = {
    .sq_length = (lenfunc)BlockIndex_len,
};

static PyTypeObject BlockIndexType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "copse.router._native.BlockIndex",
    .tp_doc = PyDoc_STR("Block hash -> the worker slots holding that block."),
    .tp_basicsize = sizeof(BlockIndexObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)BlockIndex_init,
    .tp_dealloc = (destructor)BlockIndex_dealloc,
    .tp_methods = BlockIndex_methods,
    .tp_getset = BlockIndex_getset,
    .tp_as_sequence = &BlockIndex_as_sequence,
};

/* ---- BlockRefs ------------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    Table table; /* value: reference count */
} BlockRefsObject;

static uint64_t slot_key(Py_ssize_t slot, uint64_t block)
{
    return block ^ ((uint64_t)(slot + 1) * 0x9e3779b97f4a7c15ULL);
}

static int BlockRefs_init(BlockRefsObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, ":BlockRefs", kwlist))
        return -1;
    return table_init(&self->table, 1);
}

static void BlockRefs_dealloc(BlockRefsObject *self)
{
    PyMem_Free(self->table.entries);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static Py_ssize_t acquire_one(void *object, Py_ssize_t slot, uint64_t block)
{
    Table *t = &((BlockRefsObject *)object)->table;
    Py_ssize_t i = table_find_or_insert(t, slot_key(slot, block));
    if (i < 0)
        return -1;
    return (*table_value(t, (size_t)i))++ == 0;
}

static Py_ssize_t release_one(void *object, Py_ssize_t slot, uint64_t block)
{
    Table *t = &((BlockRefsObject *)object)->table;
    Py_ssize_t i = table_find(t, slot_key(slot, block));
    if (i < 0)
        return 0;
    if (--*table_value(t, (size_t)i))
        return 0;
    table_delete_at(t, (size_t)i);
    return 1;
}

static PyObject *BlockRefs_acquire(BlockRefsObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    return for_each_block(self, args, nargs, "acquire", acquire_one);
}

static PyObject *BlockRefs_release(BlockRefsObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    return for_each_block(self, args, nargs, "release", release_one);
}

static PyObject *BlockRefs_leading_blocks(BlockRefsObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "leading_blocks() takes block hashes and an output array");
        return NULL;
    }
    Py_buffer out;
    if (get_vector(args[1], &out, "out", 1) < 0)
        return NULL;
    PyObject *hashes = PySequence_Fast(args[0], "block hashes must be a sequence");
    if (!hashes) {
        PyBuffer_Release(&out);
        return NULL;
    }
    double *depth = out.buf;
    Py_ssize_t size = out.len / (Py_ssize_t)sizeof(double);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(hashes);
    PyObject **items = PySequence_Fast_ITEMS(hashes);
    PyObject *result = NULL;
    uint64_t *blocks = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(uint64_t));
    if (!blocks) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t d = 0; d < n; d++) {
        if (read_u64(items[d], &blocks[d]) < 0)
            goto done;
    }
    for (Py_ssize_t slot = 0; slot < size; slot++) {
        Py_ssize_t d = 0;
        while (d < n && table_find(&self->table, slot_key(slot, blocks[d])) >= 0)
            d++;
        depth[slot] = (double)d;
    }
    Py_INCREF(Py_None);
    result = Py_None;
done:
    PyMem_Free(blocks);
    Py_DECREF(hashes);
    PyBuffer_Release(&out);
    return result;
}

static Py_ssize_t BlockRefs_len(BlockRefsObject *self)
{
    return (Py_ssize_t)self->table.count;
}

static PyMethodDef BlockRefs_methods[] = {
    {"acquire", (PyCFunction)(void (*)(void))BlockRefs_acquire, METH_FASTCALL,
     "acquire(slot, hashes) -> int: one more reference to each block on the slot; returns how many "
     "blocks were not in use there."},
    {"release", (PyCFunction)(void (*)(void))BlockRefs_release, METH_FASTCALL,
     "release(slot, hashes) -> int: one reference less to each block (unknown ones are ignored); "
     "returns how many blocks are no longer in use there."},
    {"leading_blocks", (PyCFunction)(void (*)(void))BlockRefs_leading_blocks, METH_FASTCALL,
     "leading_blocks(hashes, out): out[slot] = leading blocks of hashes in use on the slot, for every "
     "slot below len(out)."},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods BlockRefs_as_sequence = {
    .sq_length = (lenfunc)BlockRefs_len,
};

static PyTypeObject BlockRefsType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "copse.router._native.BlockRefs",
    .tp_doc = PyDoc_STR("(worker slot, block hash) -> in-flight requests using that block there."),
    .tp_basicsize = sizeof(BlockRefsObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)BlockRefs_init,
    .tp_dealloc = (destructor)BlockRefs_dealloc,
    .tp_methods = BlockRefs_methods,
    .tp_as_sequence = &BlockRefs_as_sequence,
};

/* ---- per-worker arithmetic ------------------------------------------------------------------- */

/* numpy's maximum/minimum (a NaN first operand propagates). */
static double maximum(double a, double b) { return (a >= b || a != a) ? a : b; }
static double minimum(double a, double b) { return (a <= b || a != a) ? a : b; }

/* copse.router.cost.Interpolant at one point. */
static double interpolate(const double *xs, const double *ys, const double *slopes, Py_ssize_t n, double x)
{
    if (x >= xs[n - 1])
        return ys[n - 1];
    if (x <= xs[0])
        return ys[0];
    Py_ssize_t lo = 0, hi = n; /* bisect_right */
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (x < xs[mid])
            hi = mid;
        else
            lo = mid + 1;
    }
    Py_ssize_t i = lo - 1;
    if (xs[i] == x)
        return ys[i];
    return slopes[i] * (x - xs[i]) + ys[i];
}

enum {
    T_DEPTHS,
    T_PREFILL_TOKENS,
    T_STEP_MS,
    T_PREFILL_MS,
    T_HEAD_START,
    T_HEAD_MS,
    T_CURVE_XS,
    T_CURVE_YS,
    T_CURVE_SLOPES,
    T_OUT_TTFT,
    T_OUT_UNCACHED,
    T_VECTORS,
};

static const char *ttft_vector_names[T_VECTORS] = {
    "depths", "prefill_tokens", "step_ms", "prefill_ms", "head_start", "head_ms",
    "curve_xs", "curve_ys", "curve_slopes", "out_ttft", "out_uncached",
};

/* ttft_ms(depths, prefill_tokens, step_ms, prefill_ms, head_start, head_ms, curve_xs, curve_ys,
 *         curve_slopes, out_ttft, out_uncached, prompt_tokens, block_size, step_budget, now,
 *         full_ms) -> None: see copse.router.policies.Selection.ttft_ms. */
static PyObject *ttft_ms(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != T_VECTORS + 5) {
        PyErr_Format(PyExc_TypeError, "ttft_ms() takes %d arguments, got %zd", T_VECTORS + 5, nargs);
        return NULL;
    }
    double scalars[5];
    for (int k = 0; k < 5; k++) {
        scalars[k] = PyFloat_AsDouble(args[T_VECTORS + k]);
        if (scalars[k] == -1.0 && PyErr_Occurred())
            return NULL;
    }
    double isl = scalars[0], bs = scalars[1], budget = scalars[2], now = scalars[3], full = scalars[4];
    Py_buffer view[T_VECTORS];
    int got = 0;
    for (; got < T_VECTORS; got++) {
        int writable = got == T_OUT_TTFT || got == T_OUT_UNCACHED;
        if (get_vector(args[got], &view[got], ttft_vector_names[got], writable) < 0)
            break;
    }
    PyObject *result = NULL;
    if (got == T_VECTORS) {
        Py_ssize_t size = view[T_OUT_TTFT].len / (Py_ssize_t)sizeof(double);
        Py_ssize_t points = view[T_CURVE_XS].len / (Py_ssize_t)sizeof(double);
        int sizes_ok = points > 0 && view[T_CURVE_YS].len == view[T_CURVE_XS].len
                       && view[T_CURVE_SLOPES].len >= view[T_CURVE_XS].len - (Py_ssize_t)sizeof(double);
        for (int k = 0; k < T_CURVE_XS; k++)
            sizes_ok &= view[k].len >= view[T_OUT_TTFT].len;
        sizes_ok &= view[T_OUT_UNCACHED].len == view[T_OUT_TTFT].len;
        if (!sizes_ok) {
            PyErr_SetString(PyExc_ValueError, "ttft_ms(): per-slot arrays shorter than the output, or a bad curve");
        } else {
            const double *depth = view[T_DEPTHS].buf, *tokens = view[T_PREFILL_TOKENS].buf;
            const double *step = view[T_STEP_MS].buf, *prefill = view[T_PREFILL_MS].buf;
            const double *head_start = view[T_HEAD_START].buf, *head_ms = view[T_HEAD_MS].buf;
            const double *xs = view[T_CURVE_XS].buf, *ys = view[T_CURVE_YS].buf;
            const double *slopes = view[T_CURVE_SLOPES].buf;
            double *ttft = view[T_OUT_TTFT].buf, *uncached = view[T_OUT_UNCACHED].buf;
            double limit = maximum(isl - 1.0, 0.0); /* at least one token is always computed */
            double last_depth = -1.0, own = 0.0, cached = 0.0;
            for (Py_ssize_t s = 0; s < size; s++) {
                if (depth[s] != last_depth) {
                    last_depth = depth[s];
                    cached = minimum(last_depth * bs, limit);
                    own = full - interpolate(xs, ys, slopes, points, cached);
                }
                double unc = isl - cached;
                double steps = ceil((tokens[s] + unc) / budget) * step[s];
                double progress = maximum((now - head_start[s]) * 1000.0, 0.0);
                progress = minimum(progress, head_ms[s]);
                double backlog = maximum(prefill[s] - progress, 0.0);
                ttft[s] = backlog + own + steps;
                uncached[s] = unc;
            }
            Py_INCREF(Py_None);
            result = Py_None;
        }
    }
    for (int k = 0; k < got; k++)
        PyBuffer_Release(&view[k]);
    return result;
}

/* lowest(costs, exclusion) -> the slot of lowest cost + exclusion (exclusion may be None), or the
 * list of slots within 1e-9 relative of it when several are: see policies.pick_lowest. */
static PyObject *lowest(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "lowest() takes costs and an exclusion array or None");
        return NULL;
    }
    Py_buffer costs_view, exclusion_view;
    int excluding = args[1] != Py_None;
    if (get_vector(args[0], &costs_view, "costs", 0) < 0)
        return NULL;
    if (excluding && get_vector(args[1], &exclusion_view, "exclusion", 0) < 0) {
        PyBuffer_Release(&costs_view);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t size = costs_view.len / (Py_ssize_t)sizeof(double);
    if (size == 0 || (excluding && exclusion_view.len != costs_view.len)) {
        PyErr_SetString(PyExc_ValueError, "lowest(): empty costs, or an exclusion of another length");
        goto done;
    }
    const double *costs = costs_view.buf;
    const double *exclusion = excluding ? exclusion_view.buf : NULL;
    /* numpy's argmin: the first minimum, a NaN counting as the minimum. */
    Py_ssize_t best = 0;
    double low = excluding ? costs[0] + exclusion[0] : costs[0];
    for (Py_ssize_t s = 1; s < size && low == low; s++) {
        double value = excluding ? costs[s] + exclusion[s] : costs[s];
        if (value < low || value != value) {
            low = value;
            best = s;
        }
    }
    double bound = low + 1e-9 * maximum(1.0, fabs(low));
    Py_ssize_t ties = 0;
    for (Py_ssize_t s = 0; s < size; s++)
        ties += (excluding ? costs[s] + exclusion[s] : costs[s]) <= bound;
    if (ties <= 1) {
        result = PyLong_FromSsize_t(best);
        goto done;
    }
    result = PyList_New(ties);
    if (!result)
        goto done;
    Py_ssize_t k = 0;
    for (Py_ssize_t s = 0; s < size; s++) {
        if ((excluding ? costs[s] + exclusion[s] : costs[s]) <= bound) {
            PyObject *slot = PyLong_FromSsize_t(s);
            if (!slot) {
                Py_CLEAR(result);
                goto done;
            }
            PyList_SET_ITEM(result, k++, slot);
        }
    }
done:
    PyBuffer_Release(&costs_view);
    if (excluding)
        PyBuffer_Release(&exclusion_view);
    return result;
}

static PyMethodDef module_methods[] = {
    {"ttft_ms", (PyCFunction)(void (*)(void))ttft_ms, METH_FASTCALL,
     "Predicted time to first token on every worker slot (see policies.Selection.ttft_ms)."},
    {"lowest", (PyCFunction)(void (*)(void))lowest, METH_FASTCALL,
     "The slot of lowest cost, or the list of tied slots (see policies.pick_lowest)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "copse.router._native",
    .m_doc = "The routing decision's inner loops, compiled (see copse.router.indexer and copse.router.policies).",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__native(void)
{
    if (PyType_Ready(&BlockIndexType) < 0 || PyType_Ready(&BlockRefsType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&module_def);
    if (!module)
        return NULL;
    if (PyModule_AddObjectRef(module, "BlockIndex", (PyObject *)&BlockIndexType) < 0
        || PyModule_AddObjectRef(module, "BlockRefs", (PyObject *)&BlockRefsType) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
