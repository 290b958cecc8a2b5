/* The routing decision's inner loops, compiled: the prefix index, the blocks in use, and the
 * per-worker arithmetic.
 *
 * Table: u64 key -> `words` u64 value words, open addressing with linear probing and
 * backward-shift deletion (no tombstones). An entry is its key followed by its value (one cache
 * line to look a block up) and is empty when its value is zero: nothing zero is stored.
 *
 * BlockIndex: block hash -> bitmask of the worker slots holding that block (the value is as many
 * words as the highest slot seen needs), on whichever tier of its cache the slot holds it. A
 * second table holds, for the blocks some slot keeps below the GPU (tier 1: host memory, tier 2:
 * disk), block hash -> those slots per tier, the tiers' words interleaved (host word w, disk word
 * w) so that growing the masks keeps them in place; it is empty, and costs the walk one branch,
 * while no engine offloads.
 *
 * LoadTable: the router's in-flight load per worker slot, in rows of a float64 array the Python
 * side owns and binds (LOAD_ROWS), and the blocks each worker's in-flight requests use, as
 * (worker slot, block hash) -> reference count keyed by the hash mixed with the slot (a bijection
 * per slot; across slots two pairs collide as rarely as two 64-bit block hashes do). It also
 * computes the load-dependent cost terms (refresh) and every worker's predicted time to first
 * token (ttft), from Curve and Grid interpolants of the perf model.
 *
 * The arithmetic is that of copse.router.cost and copse.router.policies, operation for operation
 * as the numpy formulation it replaced (same IEEE double results; built with -ffp-contract=off so
 * that no multiply-add is fused).
 *
 * Everything here runs under the GIL and keeps no Python references, so it needs no GC support.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <string.h>

/* The SHA-256 of this file, as setup.py computed it for the build (SOURCE_SHA256 in the module):
 * copse.router.loops compares it with the source it sits next to, so a stale build is not used. */
#ifndef COPSE_NATIVE_SOURCE_SHA256
#define COPSE_NATIVE_SOURCE_SHA256 "unknown"
#endif

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
    if (!t->cap) /* an object whose __init__ never ran */
        return -1;
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
    if (2 * (t->count + 1) > t->cap && table_resize(t, t->cap ? 2 * t->cap : INITIAL_CAPACITY, t->words) < 0)
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
    PyObject *number = item;
    if (!PyLong_CheckExact(item) && !(number = PyNumber_Index(item)))
        return -1;
    /* PyLong_AsUnsignedLongLong goes through a generic byte conversion in 3.11; the mask variant
     * reads the digits directly once the range is checked. */
    int fits = _PyLong_Sign(number) >= 0 && _PyLong_NumBits(number) <= 64;
    if (fits)
        *out = PyLong_AsUnsignedLongLongMask(number);
    if (number != item)
        Py_DECREF(number);
    if (!fits) {
        PyErr_Clear(); /* _PyLong_NumBits may have overflowed on a huge value */
        PyErr_Format(PyExc_ValueError, "block hash %R is not an unsigned 64-bit integer", item);
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

/* The hash at `k` of *seq (a list or tuple from PySequence_Fast) as a u64. An exact int is read
 * in place. Anything else goes through __index__, which may run Python code that mutates a list
 * (freeing the item array and the items read from it): a list is first replaced by a tuple copy of
 * itself, which holds its own references, so every hash read is one the sequence held when no
 * Python code had yet run. */
static int key_at(PyObject **seq, Py_ssize_t k, uint64_t *out)
{
    PyObject *item = PySequence_Fast_GET_ITEM(*seq, k);
    if (!PyLong_CheckExact(item) && PyList_Check(*seq)) {
        PyObject *frozen = PyList_AsTuple(*seq);
        if (!frozen)
            return -1;
        Py_SETREF(*seq, frozen);
        item = PyTuple_GET_ITEM(frozen, k);
    }
    return read_u64(item, out);
}

/* The block hashes of one call as u64 keys, every one checked (held on the stack when few). */
typedef struct {
    PyObject *fast; /* the PySequence_Fast the keys were read from */
    uint64_t *keys;
    Py_ssize_t n;
    uint64_t on_stack[256];
} Hashes;

static void release_hashes(Hashes *h)
{
    if (h->keys != h->on_stack)
        PyMem_Free(h->keys);
    Py_CLEAR(h->fast);
}

static int read_hashes(Hashes *h, PyObject *hashes)
{
    h->keys = h->on_stack;
    h->n = 0;
    if (!(h->fast = PySequence_Fast(hashes, "block hashes must be iterable")))
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(h->fast);
    if (n > (Py_ssize_t)(sizeof(h->on_stack) / sizeof(h->on_stack[0]))
        && !(h->keys = PyMem_Malloc((size_t)n * sizeof(uint64_t)))) {
        h->keys = h->on_stack;
        release_hashes(h);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        if (key_at(&h->fast, k, &h->keys[k]) < 0) {
            release_hashes(h);
            return -1;
        }
    }
    h->n = n;
    return 0;
}

/* Apply `step(object, slot, hash)` to every block hash of the iterable `hashes`, adding up what
 * the steps return (each a count, or -1 on error) into *total. Every hash is checked before any
 * step runs, so a bad one changes nothing. The steps run in batches whose table entries
 * `prefetch` asks for first, so that their cache misses overlap. */
typedef Py_ssize_t (*block_step)(void *, Py_ssize_t, uint64_t);
typedef void (*block_prefetch)(void *, Py_ssize_t, uint64_t);

static int apply_to_blocks(void *self, Py_ssize_t slot, PyObject *hashes, block_prefetch prefetch,
                           block_step step, Py_ssize_t *total)
{
    enum { BATCH = 32 };
    Hashes h;
    if (read_hashes(&h, hashes) < 0)
        return -1;
    *total = 0;
    for (Py_ssize_t start = 0; start < h.n; start += BATCH) {
        Py_ssize_t end = h.n - start < BATCH ? h.n : start + BATCH;
        for (Py_ssize_t k = start; k < end; k++)
            prefetch(self, slot, h.keys[k]);
        for (Py_ssize_t k = start; k < end; k++) {
            Py_ssize_t counted = step(self, slot, h.keys[k]);
            if (counted < 0) {
                release_hashes(&h);
                return -1;
            }
            *total += counted;
        }
    }
    release_hashes(&h);
    return 0;
}

/* `name(slot, hashes) -> int`: apply_to_blocks for a Python caller. */
static PyObject *for_each_block(void *self, PyObject *const *args, Py_ssize_t nargs, const char *name,
                                block_prefetch prefetch, block_step step)
{
    Py_ssize_t slot, total;
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "%s() takes a slot and an iterable of block hashes", name);
        return NULL;
    }
    if (read_slot(args[0], &slot) < 0 || apply_to_blocks(self, slot, args[1], prefetch, step, &total) < 0)
        return NULL;
    return PyLong_FromSsize_t(total);
}

/* The arguments of `leading_blocks(hashes, out)`: a writable float64 vector and the hashes as a
 * PySequence_Fast (both to release by the caller on success). */
static int leading_blocks_args(PyObject *const *args, Py_ssize_t nargs, Py_buffer *out, PyObject **hashes)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "leading_blocks() takes block hashes and an output array");
        return -1;
    }
    if (get_vector(args[1], out, "out", 1) < 0)
        return -1;
    if (!(*hashes = PySequence_Fast(args[0], "block hashes must be a sequence"))) {
        PyBuffer_Release(out);
        return -1;
    }
    return 0;
}

static void table_prefetch(const Table *t, uint64_t key)
{
    if (t->cap)
        __builtin_prefetch(table_entry(t, table_home(t, key)));
}

/* ---- BlockIndex ------------------------------------------------------------------------------ */

/* Tiers of an engine's KV cache, as TensorRT-LLM numbers its cache levels (0 primary = GPU,
 * 1 secondary = host memory) and one more for a disk tier. */
#define LOWER_TIERS 2

typedef struct {
    PyObject_HEAD
    Table table;       /* value: bitmask of slots */
    Table lower;       /* value: per lower tier, bitmask of the slots holding the block there,
                        * LOWER_TIERS * table.words words interleaved by word */
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
    if (table_init(&self->table, 1) < 0)
        return -1;
    return table_init(&self->lower, LOWER_TIERS);
}

static void BlockIndex_dealloc(BlockIndexObject *self)
{
    PyMem_Free(self->table.entries);
    PyMem_Free(self->lower.entries);
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
    if (table_resize(&self->table, self->table.cap ? self->table.cap : INITIAL_CAPACITY, words) < 0
        || table_resize(&self->lower, self->lower.cap ? self->lower.cap : INITIAL_CAPACITY, LOWER_TIERS * words) < 0) {
        PyMem_Free(held);
        return -1;
    }
    if (old)
        memcpy(held, self->held, old * 64 * sizeof(Py_ssize_t));
    PyMem_Free(self->held);
    self->held = held;
    return 0;
}

static void index_prefetch(void *object, Py_ssize_t slot, uint64_t key)
{
    (void)slot;
    table_prefetch(&((BlockIndexObject *)object)->table, key);
}

/* The tier (1 .. LOWER_TIERS) below the GPU on which the slot keeps the block, 0 if none. */
static int lower_tier(const BlockIndexObject *self, Py_ssize_t slot, uint64_t key)
{
    const Table *t = &self->lower;
    if (!t->count || (size_t)slot >= self->table.words * 64)
        return 0;
    Py_ssize_t i = table_find(t, key);
    if (i < 0)
        return 0;
    const uint64_t *value = table_value(t, (size_t)i) + LOWER_TIERS * ((size_t)slot / 64);
    for (int k = 0; k < LOWER_TIERS; k++) {
        if (value[k] >> (slot % 64) & 1)
            return k + 1;
    }
    return 0;
}

/* The slot now keeps the block (which it holds) on `tier` (0: the GPU, so no lower tier). */
static int set_lower_tier(BlockIndexObject *self, Py_ssize_t slot, uint64_t key, int tier)
{
    Table *t = &self->lower;
    uint64_t bit = (uint64_t)1 << (slot % 64);
    size_t base = LOWER_TIERS * ((size_t)slot / 64);
    if (t->count) {
        Py_ssize_t i = table_find(t, key);
        if (i >= 0) {
            uint64_t *value = table_value(t, (size_t)i) + base;
            for (int k = 0; k < LOWER_TIERS; k++)
                value[k] &= ~bit;
            if (tier > 0) {
                value[tier - 1] |= bit;
                return 0;
            }
            if (table_empty_at(t, (size_t)i))
                table_delete_at(t, (size_t)i);
            return 0;
        }
    }
    if (tier == 0)
        return 0;
    Py_ssize_t i = table_find_or_insert(t, key);
    if (i < 0)
        return -1;
    table_value(t, (size_t)i)[base + (size_t)tier - 1] |= bit;
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
    if (*word & bit) /* stored again: on the GPU now, whichever tier it was on */
        return set_lower_tier(self, slot, key, 0);
    *word |= bit;
    self->held[slot]++;
    return 1;
}

/* set_tier's step: the tier travels in the context. */
typedef struct {
    BlockIndexObject *index;
    int tier;
} TierMove;

static void move_prefetch(void *object, Py_ssize_t slot, uint64_t key)
{
    index_prefetch(((TierMove *)object)->index, slot, key);
}

static Py_ssize_t move_one(void *object, Py_ssize_t slot, uint64_t key)
{
    TierMove *move = object;
    BlockIndexObject *self = move->index;
    if ((size_t)slot >= self->table.words * 64)
        return 0;
    Py_ssize_t i = table_find(&self->table, key);
    if (i < 0 || !(table_value(&self->table, (size_t)i)[slot / 64] >> (slot % 64) & 1))
        return 0;
    if (lower_tier(self, slot, key) == move->tier)
        return 0;
    return set_lower_tier(self, slot, key, move->tier) < 0 ? -1 : 1;
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
    return set_lower_tier(self, slot, key, 0) < 0 ? -1 : 1;
}

static PyObject *BlockIndex_store(BlockIndexObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    return for_each_block(self, args, nargs, "store", index_prefetch, store_one);
}

static PyObject *BlockIndex_remove(BlockIndexObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    return for_each_block(self, args, nargs, "remove", index_prefetch, remove_one);
}

/* Drop the bits of `slot` from every entry's words w + k * stride (k < planes), then re-lay the
 * table, since the entries emptied are holes inside clusters. */
static int drop_slot(Table *t, Py_ssize_t slot, size_t planes)
{
    size_t w = planes * ((size_t)slot / 64);
    uint64_t keep = ~((uint64_t)1 << (slot % 64));
    for (size_t i = 0; i < t->cap; i++) {
        if (!table_empty_at(t, i)) {
            for (size_t k = 0; k < planes; k++)
                table_value(t, i)[w + k] &= keep;
            t->count -= table_empty_at(t, i);
        }
    }
    return table_resize(t, t->cap, t->words);
}

static PyObject *BlockIndex_clear(BlockIndexObject *self, PyObject *arg)
{
    Py_ssize_t slot;
    if (read_slot(arg, &slot) < 0)
        return NULL;
    if ((size_t)slot >= self->table.words * 64 || !self->held[slot])
        Py_RETURN_NONE;
    /* Rare: a worker reset or left. */
    self->held[slot] = 0;
    if (drop_slot(&self->table, slot, 1) < 0 || (self->lower.count && drop_slot(&self->lower, slot, LOWER_TIERS) < 0))
        return NULL;
    Py_RETURN_NONE;
}

static int read_tier(PyObject *arg, int *tier)
{
    long value = PyLong_AsLong(arg);
    if (value == -1 && PyErr_Occurred())
        return -1;
    if (value < 0 || value > LOWER_TIERS) {
        PyErr_Format(PyExc_ValueError, "cache tier %ld is outside 0 .. %d", value, LOWER_TIERS);
        return -1;
    }
    *tier = (int)value;
    return 0;
}

static PyObject *BlockIndex_set_tier(BlockIndexObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t slot, total;
    TierMove move = {.index = self};
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "set_tier() takes a slot, an iterable of block hashes and a tier");
        return NULL;
    }
    if (read_slot(args[0], &slot) < 0 || read_tier(args[2], &move.tier) < 0
        || apply_to_blocks(&move, slot, args[1], move_prefetch, move_one, &total) < 0)
        return NULL;
    return PyLong_FromSsize_t(total);
}

static PyObject *BlockIndex_tier(BlockIndexObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t slot;
    uint64_t key;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "tier() takes a slot and a block hash");
        return NULL;
    }
    if (read_slot(args[0], &slot) < 0 || read_u64(args[1], &key) < 0)
        return NULL;
    if ((size_t)slot >= self->table.words * 64)
        return PyLong_FromLong(-1);
    Py_ssize_t i = table_find(&self->table, key);
    if (i < 0 || !(table_value(&self->table, (size_t)i)[slot / 64] >> (slot % 64) & 1))
        return PyLong_FromLong(-1);
    return PyLong_FromLong(lower_tier(self, slot, key));
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

/* depth[slot] = leading blocks of *hashes (a PySequence_Fast, see key_at) the slot holds, for
 * slots < size; with `lower` (LOWER_TIERS rows of size), lower[k * size + slot] = how many of them
 * it keeps on tier k + 1. */
static int walk(const BlockIndexObject *self, PyObject **hashes, double *depth, double *lower, size_t size)
{
    const Table *t = &self->table, *lt = &self->lower;
    size_t words = t->words;
    memset(depth, 0, size * sizeof(double));
    if (lower)
        memset(lower, 0, LOWER_TIERS * size * sizeof(double));
    int tiered = lower && lt->count;
    if (!words) /* an index whose __init__ never ran holds nothing */
        return 0;
    /* Slots still holding every block so far; slots beyond the output are not asked about. */
    uint64_t active[words];
    int any = 0;
    for (size_t w = 0; w < words; w++) {
        size_t first = w * 64;
        active[w] = first >= size ? 0 : size - first >= 64 ? ~(uint64_t)0 : ((uint64_t)1 << (size - first)) - 1;
        any |= active[w] != 0;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(*hashes);
    /* The look-ups miss the cache (the table is megabytes): convert a batch of hashes and prefetch
     * their home entries so that the misses overlap, then walk the batch. */
    enum { BATCH = 32 };
    uint64_t keys[BATCH];
    Py_ssize_t d = 0;
    while (d < n && any) {
        Py_ssize_t batch = n - d < BATCH ? n - d : BATCH;
        for (Py_ssize_t k = 0; k < batch; k++) {
            if (key_at(hashes, d + k, &keys[k]) < 0)
                return -1;
            table_prefetch(t, keys[k]);
            if (tiered)
                table_prefetch(lt, keys[k]);
        }
        for (Py_ssize_t k = 0; k < batch && any; k++, d++) {
            Py_ssize_t i = table_find(t, keys[k]);
            const uint64_t *held = i < 0 ? NULL : table_value(t, (size_t)i);
            Py_ssize_t j = tiered && held ? table_find(lt, keys[k]) : -1;
            const uint64_t *below = j < 0 ? NULL : table_value(lt, (size_t)j);
            any = 0;
            for (size_t w = 0; w < words; w++) {
                uint64_t kept = held ? active[w] & held[w] : 0;
                uint64_t dropped = active[w] & ~kept;
                while (dropped) {
                    depth[w * 64 + (size_t)__builtin_ctzll(dropped)] = (double)d;
                    dropped &= dropped - 1;
                }
                for (size_t tier = 0; below && tier < LOWER_TIERS; tier++) {
                    for (uint64_t on = kept & below[LOWER_TIERS * w + tier]; on; on &= on - 1)
                        lower[tier * size + w * 64 + (size_t)__builtin_ctzll(on)] += 1.0;
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
    return 0;
}

static PyObject *BlockIndex_leading_blocks(BlockIndexObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer out;
    PyObject *hashes;
    if (leading_blocks_args(args, nargs, &out, &hashes) < 0)
        return NULL;
    int failed = walk(self, &hashes, out.buf, NULL, (size_t)(out.len / (Py_ssize_t)sizeof(double))) < 0;
    Py_DECREF(hashes);
    PyBuffer_Release(&out);
    if (failed)
        return NULL;
    Py_RETURN_NONE;
}

/* A writable C-contiguous float64 array of `rows` rows (its columns in *size). */
static int get_rows(PyObject *obj, Py_buffer *view, Py_ssize_t rows, Py_ssize_t *size)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) < 0)
        return -1;
    if (view->ndim != 2 || view->shape[0] != rows || view->itemsize != sizeof(double) || !view->format
        || strcmp(view->format, "d") != 0 || (*size >= 0 && view->shape[1] != *size)) {
        if (*size >= 0)
            PyErr_Format(PyExc_TypeError, "out must be a writable C-contiguous float64 array of shape (%zd, %zd)",
                         rows, *size);
        else
            PyErr_Format(PyExc_TypeError, "out must be a writable C-contiguous float64 array of %zd rows", rows);
        PyBuffer_Release(view);
        return -1;
    }
    *size = view->shape[1];
    return 0;
}

static PyObject *BlockIndex_leading_tiers(BlockIndexObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer out;
    Py_ssize_t size = -1;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "leading_tiers() takes block hashes and an output array");
        return NULL;
    }
    if (get_rows(args[1], &out, 1 + LOWER_TIERS, &size) < 0)
        return NULL;
    PyObject *hashes = PySequence_Fast(args[0], "block hashes must be a sequence");
    if (!hashes) {
        PyBuffer_Release(&out);
        return NULL;
    }
    double *depth = out.buf;
    int failed = walk(self, &hashes, depth, depth + size, (size_t)size) < 0;
    Py_DECREF(hashes);
    PyBuffer_Release(&out);
    if (failed)
        return NULL;
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
     "holds(slot, block): whether the slot holds the block (on any tier)."},
    {"set_tier", (PyCFunction)(void (*)(void))BlockIndex_set_tier, METH_FASTCALL,
     "set_tier(slot, hashes, tier) -> int: the slot keeps these blocks on tier 0 (GPU), 1 (host) or 2 "
     "(disk) now (blocks it does not hold are ignored); returns how many moved."},
    {"tier", (PyCFunction)(void (*)(void))BlockIndex_tier, METH_FASTCALL,
     "tier(slot, block) -> int: the tier the slot keeps the block on, -1 when it does not hold it."},
    {"blocks_held", (PyCFunction)BlockIndex_blocks_held, METH_O, "blocks_held(slot): blocks the slot holds."},
    {"leading_blocks", (PyCFunction)(void (*)(void))BlockIndex_leading_blocks, METH_FASTCALL,
     "leading_blocks(hashes, out): out[slot] = leading blocks of hashes the slot holds, for every slot "
     "below len(out)."},
    {"leading_tiers", (PyCFunction)(void (*)(void))BlockIndex_leading_tiers, METH_FASTCALL,
     "leading_tiers(hashes, out): out[0] as leading_blocks, out[1] and out[2] how many of those blocks "
     "each slot keeps on the host and on disk."},
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

/* ---- curves ---------------------------------------------------------------------------------- */

/* numpy's maximum/minimum (a NaN first operand propagates). */
static double maximum(double a, double b) { return (a >= b || a != a) ? a : b; }
static double minimum(double a, double b) { return (a <= b || a != a) ? a : b; }

/* bisect_right / numpy's searchsorted(side="right") over n increasing values. */
static Py_ssize_t bisect_right(const double *xs, Py_ssize_t n, double x)
{
    Py_ssize_t lo = 0, hi = n;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (x < xs[mid])
            hi = mid;
        else
            lo = mid + 1;
    }
    return lo;
}

/* A copy of a float64 vector argument in C memory (NULL with an exception set on failure). */
static double *copy_vector(PyObject *obj, const char *name, Py_ssize_t *n)
{
    Py_buffer view;
    if (get_vector(obj, &view, name, 0) < 0)
        return NULL;
    *n = view.len / (Py_ssize_t)sizeof(double);
    double *out = PyMem_Malloc((size_t)(*n ? *n : 1) * sizeof(double));
    if (out)
        memcpy(out, view.buf, (size_t)view.len);
    else
        PyErr_NoMemory();
    PyBuffer_Release(&view);
    return out;
}

typedef struct {
    PyObject_HEAD
    double *xs, *ys, *slopes;
    Py_ssize_t n;
} CurveObject;

/* The piecewise-linear function through (xs[i], ys[i]), constant beyond the ends; the same
 * arithmetic as numpy's interp at one point. */
static double curve_at(const CurveObject *c, double x)
{
    const double *xs = c->xs, *ys = c->ys;
    Py_ssize_t n = c->n;
    if (x >= xs[n - 1])
        return ys[n - 1];
    if (x <= xs[0])
        return ys[0];
    Py_ssize_t i = bisect_right(xs, n, x) - 1;
    if (xs[i] == x)
        return ys[i];
    return c->slopes[i] * (x - xs[i]) + ys[i];
}

static int Curve_init(CurveObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"xs", "ys", NULL};
    PyObject *xs_obj, *ys_obj;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO:Curve", kwlist, &xs_obj, &ys_obj))
        return -1;
    Py_ssize_t n, m;
    PyMem_Free(self->xs);
    PyMem_Free(self->ys);
    PyMem_Free(self->slopes);
    self->xs = copy_vector(xs_obj, "xs", &n);
    self->ys = self->xs ? copy_vector(ys_obj, "ys", &m) : NULL;
    self->slopes = NULL;
    if (!self->ys)
        return -1;
    if (n < 1 || m != n) {
        PyErr_Format(PyExc_ValueError, "a curve needs as many ys as xs (at least one), got %zd and %zd", n, m);
        return -1;
    }
    for (Py_ssize_t i = 1; i < n; i++) {
        if (!(self->xs[i] > self->xs[i - 1])) {
            PyErr_Format(PyExc_ValueError, "curve xs must increase, but xs[%zd] <= xs[%zd]", i, i - 1);
            return -1;
        }
    }
    self->slopes = PyMem_Malloc((size_t)n * sizeof(double));
    if (!self->slopes) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i + 1 < n; i++)
        self->slopes[i] = (self->ys[i + 1] - self->ys[i]) / (self->xs[i + 1] - self->xs[i]);
    self->n = n;
    return 0;
}

static void Curve_dealloc(CurveObject *self)
{
    PyMem_Free(self->xs);
    PyMem_Free(self->ys);
    PyMem_Free(self->slopes);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int curve_ready(const CurveObject *self)
{
    if (self->slopes)
        return 1;
    PyErr_SetString(PyExc_ValueError, "the curve was not initialised");
    return 0;
}

static PyObject *Curve_call(CurveObject *self, PyObject *args, PyObject *kwds)
{
    double x;
    static char *kwlist[] = {"x", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "d:Curve", kwlist, &x) || !curve_ready(self))
        return NULL;
    return PyFloat_FromDouble(curve_at(self, x));
}

static PyTypeObject CurveType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "copse.router._native.Curve",
    .tp_doc = PyDoc_STR("Curve(xs, ys): the piecewise-linear function through the points, constant beyond "
                        "the ends; curve(x) is numpy.interp(x, xs, ys) to the bit."),
    .tp_basicsize = sizeof(CurveObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Curve_init,
    .tp_dealloc = (destructor)Curve_dealloc,
    .tp_call = (ternaryfunc)Curve_call,
};

typedef struct {
    PyObject_HEAD
    double *active, *context, *values; /* values: active x context, row-major */
    Py_ssize_t na, nc;
} GridObject;

/* copse.router.cost.PerfTable.itl_ms at one worker: bilinear over (active KV, mean context),
 * clamped to the grid, operation for operation as the numpy formulation. */
static double grid_at(const GridObject *g, double active_kv, double sequences)
{
    const double *A = g->active, *C = g->context;
    Py_ssize_t na = g->na, nc = g->nc;
    double context_length = active_kv / maximum(sequences, 1.0);
    double a = minimum(maximum(active_kv, A[0]), A[na - 1]);
    double c = minimum(maximum(context_length, C[0]), C[nc - 1]);
    Py_ssize_t i = bisect_right(A, na, a), j = bisect_right(C, nc, c);
    i = i < na - 1 ? i : na - 1;
    j = j < nc - 1 ? j : nc - 1;
    double a0 = A[i - 1], c0 = C[j - 1];
    double s = (a - a0) / (A[i] - a0);
    double t = (c - c0) / (C[j] - c0);
    const double *low_row = g->values + (i - 1) * nc, *high_row = g->values + i * nc;
    double g00 = low_row[j - 1], g01 = low_row[j];
    double low = g00 + t * (g01 - g00);
    double g10 = high_row[j - 1];
    double high = g10 + t * (high_row[j] - g10);
    return low + s * (high - low);
}

static int Grid_init(GridObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"active", "context", "values", NULL};
    PyObject *active_obj, *context_obj, *values_obj;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO:Grid", kwlist, &active_obj, &context_obj, &values_obj))
        return -1;
    PyMem_Free(self->active);
    PyMem_Free(self->context);
    PyMem_Free(self->values);
    self->context = self->values = NULL;
    self->na = self->nc = 0;
    Py_ssize_t na, nc, nv = 0;
    Py_buffer view;
    self->active = copy_vector(active_obj, "active", &na);
    if (!self->active || !(self->context = copy_vector(context_obj, "context", &nc)))
        return -1;
    if (PyObject_GetBuffer(values_obj, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    if (view.ndim == 2 && view.itemsize == sizeof(double) && view.format && strcmp(view.format, "d") == 0)
        nv = view.len / (Py_ssize_t)sizeof(double);
    if (na < 2 || nc < 2 || view.ndim != 2 || view.shape[0] != na || view.shape[1] != nc || nv != na * nc) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "a grid needs >= 2 points per axis and float64 values of shape "
                                          "(len(active), len(context))");
        return -1;
    }
    self->values = PyMem_Malloc((size_t)view.len);
    if (self->values)
        memcpy(self->values, view.buf, (size_t)view.len);
    PyBuffer_Release(&view);
    if (!self->values) {
        PyErr_NoMemory();
        return -1;
    }
    self->na = na;
    self->nc = nc;
    return 0;
}

static void Grid_dealloc(GridObject *self)
{
    PyMem_Free(self->active);
    PyMem_Free(self->context);
    PyMem_Free(self->values);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int grid_ready(const GridObject *self)
{
    if (self->values)
        return 1;
    PyErr_SetString(PyExc_ValueError, "the grid was not initialised");
    return 0;
}

static PyObject *Grid_call(GridObject *self, PyObject *args, PyObject *kwds)
{
    double active_kv, sequences;
    static char *kwlist[] = {"active_kv", "sequences", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "dd:Grid", kwlist, &active_kv, &sequences) || !grid_ready(self))
        return NULL;
    return PyFloat_FromDouble(grid_at(self, active_kv, sequences));
}

/* grid.fill(active_kv, sequences, out): out[k] = grid(active_kv[k], sequences[k]) for every k (the
 * router's per-worker decode steps in one call instead of a dozen small numpy operations). */
static PyObject *Grid_fill(GridObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "fill(active_kv, sequences, out) takes 3 arguments");
        return NULL;
    }
    if (!grid_ready(self))
        return NULL;
    Py_buffer active, sequences, out;
    if (get_vector(args[0], &active, "active_kv", 0) < 0)
        return NULL;
    if (get_vector(args[1], &sequences, "sequences", 0) < 0) {
        PyBuffer_Release(&active);
        return NULL;
    }
    if (get_vector(args[2], &out, "out", 1) < 0) {
        PyBuffer_Release(&active);
        PyBuffer_Release(&sequences);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t n = active.len / (Py_ssize_t)sizeof(double);
    if (sequences.len != active.len || out.len != active.len) {
        PyErr_SetString(PyExc_ValueError, "active_kv, sequences and out must have the same length");
    } else {
        const double *a = active.buf, *s = sequences.buf;
        double *o = out.buf;
        for (Py_ssize_t k = 0; k < n; k++)
            o[k] = grid_at(self, a[k], s[k]);
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&active);
    PyBuffer_Release(&sequences);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef Grid_methods[] = {
    {"fill", (PyCFunction)(void (*)(void))Grid_fill, METH_FASTCALL,
     "fill(active_kv, sequences, out): the grid at every pair, written to out."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject GridType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "copse.router._native.Grid",
    .tp_doc = PyDoc_STR("Grid(active, context, values): decode step time by (active KV tokens, mean context "
                        "length), bilinear and clamped; grid(active_kv, sequences)."),
    .tp_basicsize = sizeof(GridObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Grid_init,
    .tp_dealloc = (destructor)Grid_dealloc,
    .tp_call = (ternaryfunc)Grid_call,
    .tp_methods = Grid_methods,
};

/* ---- LoadTable ------------------------------------------------------------------------------- */

/* Rows of the per-worker figures (copse.router.sequences reads the names from LOAD_ROWS). */
enum {
    L_REQUESTS,
    L_PREFILLING,
    L_PREFILL_TOKENS,
    L_PREFILL_MS,
    L_ACTIVE_BLOCKS,
    L_KV_EXTRA,
    L_KV,
    L_HEAD_START,
    L_HEAD_MS,
    L_STEP_MS,
    L_FREE,
    L_ROWS,
};

static const char *load_row_names[L_ROWS] = {
    "requests", "prefilling", "prefill_tokens", "prefill_ms", "active_blocks", "kv_extra",
    "kv",       "head_start", "head_ms",        "step_ms",    "free",
};

typedef struct {
    PyObject_HEAD
    Table refs;        /* (slot, block) -> in-flight requests using that block there */
    Py_buffer columns; /* L_ROWS x size float64, bound by `bind` */
    int bound;
    Py_ssize_t size;
    double block_size;
} LoadTableObject;

static uint64_t slot_key(Py_ssize_t slot, uint64_t block)
{
    return block ^ ((uint64_t)(slot + 1) * 0x9e3779b97f4a7c15ULL);
}

static double *row(LoadTableObject *self, int r)
{
    return (double *)self->columns.buf + (Py_ssize_t)r * self->size;
}

static int LoadTable_init(LoadTableObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"block_size", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "d:LoadTable", kwlist, &self->block_size))
        return -1;
    if (self->bound) {
        PyBuffer_Release(&self->columns);
        self->bound = 0;
    }
    self->size = 0;
    return table_init(&self->refs, 1);
}

static void LoadTable_dealloc(LoadTableObject *self)
{
    if (self->bound)
        PyBuffer_Release(&self->columns);
    PyMem_Free(self->refs.entries);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *LoadTable_bind(LoadTableObject *self, PyObject *columns)
{
    Py_buffer view;
    if (PyObject_GetBuffer(columns, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) < 0)
        return NULL;
    if (view.ndim != 2 || view.shape[0] != L_ROWS || view.itemsize != sizeof(double) || !view.format
        || strcmp(view.format, "d") != 0) {
        PyBuffer_Release(&view);
        PyErr_Format(PyExc_TypeError, "columns must be a writable C-contiguous float64 array of %d rows", L_ROWS);
        return NULL;
    }
    if (self->bound)
        PyBuffer_Release(&self->columns);
    self->columns = view;
    self->bound = 1;
    self->size = view.shape[1];
    Py_RETURN_NONE;
}

static void refs_prefetch(void *object, Py_ssize_t slot, uint64_t block)
{
    table_prefetch(&((LoadTableObject *)object)->refs, slot_key(slot, block));
}

static Py_ssize_t acquire_one(void *object, Py_ssize_t slot, uint64_t block)
{
    Table *t = &((LoadTableObject *)object)->refs;
    Py_ssize_t i = table_find_or_insert(t, slot_key(slot, block));
    if (i < 0)
        return -1;
    return (*table_value(t, (size_t)i))++ == 0;
}

static Py_ssize_t release_one(void *object, Py_ssize_t slot, uint64_t block)
{
    Table *t = &((LoadTableObject *)object)->refs;
    Py_ssize_t i = table_find(t, slot_key(slot, block));
    if (i < 0)
        return 0;
    if (--*table_value(t, (size_t)i))
        return 0;
    table_delete_at(t, (size_t)i);
    return 1;
}

/* The slot argument, checked against the bound columns. */
static int bound_slot(LoadTableObject *self, PyObject *arg, Py_ssize_t *slot)
{
    if (!self->bound) {
        PyErr_SetString(PyExc_ValueError, "no columns are bound to the load table");
        return -1;
    }
    if (read_slot(arg, slot) < 0)
        return -1;
    if (*slot >= self->size) {
        PyErr_Format(PyExc_IndexError, "worker slot %zd is beyond the %zd bound columns", *slot, self->size);
        return -1;
    }
    return 0;
}

static int read_doubles(PyObject *const *args, double *out, int n)
{
    for (int k = 0; k < n; k++) {
        out[k] = PyFloat_AsDouble(args[k]);
        if (out[k] == -1.0 && PyErr_Occurred())
            return -1;
    }
    return 0;
}

static void update_kv(LoadTableObject *self, Py_ssize_t slot)
{
    row(self, L_KV)[slot] = row(self, L_ACTIVE_BLOCKS)[slot] * self->block_size + row(self, L_KV_EXTRA)[slot];
}

/* add(slot, hashes, prefill_tokens, prefill_ms, kv_tokens): a request routed to the slot. */
static PyObject *LoadTable_add(LoadTableObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t slot;
    double v[3];
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "add(slot, hashes, prefill_tokens, prefill_ms, kv_tokens)");
        return NULL;
    }
    Py_ssize_t fresh;
    if (bound_slot(self, args[0], &slot) < 0 || read_doubles(args + 2, v, 3) < 0
        || apply_to_blocks(self, slot, args[1], refs_prefetch, acquire_one, &fresh) < 0)
        return NULL;
    row(self, L_ACTIVE_BLOCKS)[slot] += (double)fresh;
    row(self, L_KV_EXTRA)[slot] += v[2];
    row(self, L_REQUESTS)[slot] += 1.0;
    row(self, L_PREFILLING)[slot] += 1.0;
    row(self, L_PREFILL_TOKENS)[slot] += v[0];
    row(self, L_PREFILL_MS)[slot] += v[1];
    update_kv(self, slot);
    Py_RETURN_NONE;
}

/* end_prefill(slot, prefill_tokens, prefill_ms): a request's first token arrived. */
static PyObject *LoadTable_end_prefill(LoadTableObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t slot;
    double v[2];
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "end_prefill(slot, prefill_tokens, prefill_ms)");
        return NULL;
    }
    if (bound_slot(self, args[0], &slot) < 0 || read_doubles(args + 1, v, 2) < 0)
        return NULL;
    row(self, L_PREFILLING)[slot] -= 1.0;
    row(self, L_PREFILL_TOKENS)[slot] -= v[0];
    row(self, L_PREFILL_MS)[slot] -= v[1];
    Py_RETURN_NONE;
}

/* free(slot, hashes, kv_tokens): a request ended (its prefill already ended). */
static PyObject *LoadTable_free(LoadTableObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t slot;
    double kv_tokens;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "free(slot, hashes, kv_tokens)");
        return NULL;
    }
    Py_ssize_t gone;
    if (bound_slot(self, args[0], &slot) < 0 || read_doubles(args + 2, &kv_tokens, 1) < 0
        || apply_to_blocks(self, slot, args[1], refs_prefetch, release_one, &gone) < 0)
        return NULL;
    row(self, L_ACTIVE_BLOCKS)[slot] -= (double)gone;
    row(self, L_KV_EXTRA)[slot] -= kv_tokens;
    row(self, L_REQUESTS)[slot] -= 1.0;
    if (row(self, L_REQUESTS)[slot] == 0.0) {
        /* Exact zero, not an accumulated float residue. */
        row(self, L_KV_EXTRA)[slot] = 0.0;
        row(self, L_PREFILL_MS)[slot] = 0.0;
    }
    update_kv(self, slot);
    Py_RETURN_NONE;
}

/* leading_blocks(hashes, out): out[slot] = leading blocks of hashes in use on the slot. */
static PyObject *LoadTable_leading_blocks(LoadTableObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer out;
    PyObject *sequence;
    Hashes h;
    if (leading_blocks_args(args, nargs, &out, &sequence) < 0)
        return NULL;
    int failed = read_hashes(&h, sequence) < 0;
    Py_DECREF(sequence);
    if (!failed) {
        double *depth = out.buf;
        Py_ssize_t size = out.len / (Py_ssize_t)sizeof(double);
        for (Py_ssize_t slot = 0; slot < size; slot++) {
            Py_ssize_t d = 0;
            while (d < h.n && table_find(&self->refs, slot_key(slot, h.keys[d])) >= 0)
                d++;
            depth[slot] = (double)d;
        }
        release_hashes(&h);
    }
    PyBuffer_Release(&out);
    if (failed)
        return NULL;
    Py_RETURN_NONE;
}

/* refresh(slots, itl, f0, busy_prefill_tokens, busy_kv_tokens) -> flips: the step time and the
 * free flag of every slot in the iterable `slots` (see copse.router.cost.WorkerCosts); returns how
 * many free flags changed. `itl` is a Curve over active KV tokens or a Grid. */
static PyObject *LoadTable_refresh(LoadTableObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    double v[3];
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "refresh(slots, itl, f0, busy_prefill_tokens, busy_kv_tokens)");
        return NULL;
    }
    int by_curve = PyObject_TypeCheck(args[1], &CurveType);
    if (!by_curve && !PyObject_TypeCheck(args[1], &GridType)) {
        PyErr_SetString(PyExc_TypeError, "itl must be a Curve or a Grid");
        return NULL;
    }
    if ((by_curve && !curve_ready((CurveObject *)args[1])) || (!by_curve && !grid_ready((GridObject *)args[1]))
        || read_doubles(args + 2, v, 3) < 0)
        return NULL;
    double f0 = v[0], busy_prefill = v[1], busy_kv = v[2];
    PyObject *iterator = PyObject_GetIter(args[0]);
    if (!iterator)
        return NULL;
    Py_ssize_t flips = 0;
    PyObject *item;
    while ((item = PyIter_Next(iterator))) {
        Py_ssize_t slot;
        /* A slot's __index__ may run Python code: the curve or grid is checked after it. */
        int failed = bound_slot(self, item, &slot) < 0 || (by_curve && !curve_ready((CurveObject *)args[1]))
                     || (!by_curve && !grid_ready((GridObject *)args[1]));
        Py_DECREF(item);
        if (failed) {
            Py_DECREF(iterator);
            return NULL;
        }
        double active_kv = row(self, L_KV)[slot], sequences = row(self, L_REQUESTS)[slot];
        double step = f0;
        /* The decode step joins every prefill step while some sequence decodes. */
        if (sequences > row(self, L_PREFILLING)[slot])
            step = f0 + (by_curve ? curve_at((CurveObject *)args[1], active_kv)
                                  : grid_at((GridObject *)args[1], active_kv, sequences));
        row(self, L_STEP_MS)[slot] = step;
        double now_free = !(row(self, L_PREFILL_TOKENS)[slot] > busy_prefill || active_kv > busy_kv);
        if (now_free != row(self, L_FREE)[slot]) {
            row(self, L_FREE)[slot] = now_free;
            flips++;
        }
    }
    Py_DECREF(iterator);
    if (PyErr_Occurred())
        return NULL;
    return PyLong_FromSsize_t(flips);
}

/* ttft(index, hashes, out, prefill_curve, prompt_tokens, block_size, step_budget, now, full_ms,
 * host_block_ms, disk_block_ms): rows of `out` (5 x size): the leading blocks of `hashes` each worker
 * holds in `index`, how many of them it keeps on the host and on disk, its predicted time to first
 * token (ms: with the onboarding of those blocks at the given ms per block) and the prompt tokens it
 * would compute; see copse.router.policies.Selection.ttft_ms. */
static PyObject *LoadTable_ttft(LoadTableObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    double v[7];
    if (nargs != 11) {
        PyErr_SetString(PyExc_TypeError, "ttft(index, hashes, out, prefill_curve, prompt_tokens, block_size, "
                                         "step_budget, now, full_ms, host_block_ms, disk_block_ms)");
        return NULL;
    }
    if (!PyObject_TypeCheck(args[0], &BlockIndexType) || !PyObject_TypeCheck(args[3], &CurveType)) {
        PyErr_SetString(PyExc_TypeError, "ttft() takes a BlockIndex and a Curve");
        return NULL;
    }
    const CurveObject *curve = (CurveObject *)args[3];
    if (!curve_ready(curve) || read_doubles(args + 4, v, 7) < 0)
        return NULL;
    if (!self->bound) {
        PyErr_SetString(PyExc_ValueError, "no columns are bound to the load table");
        return NULL;
    }
    double isl = v[0], bs = v[1], budget = v[2], now = v[3], full = v[4], host_ms = v[5], disk_ms = v[6];
    Py_buffer out;
    Py_ssize_t size = self->size;
    if (get_rows(args[2], &out, 3 + LOWER_TIERS, &size) < 0)
        return NULL;
    double *depth = out.buf, *host = depth + size, *disk = host + size, *ttft = disk + size, *uncached = ttft + size;
    PyObject *hashes = PySequence_Fast(args[1], "block hashes must be a sequence");
    if (!hashes || walk((BlockIndexObject *)args[0], &hashes, depth, host, (size_t)size) < 0) {
        Py_XDECREF(hashes);
        PyBuffer_Release(&out);
        return NULL;
    }
    Py_DECREF(hashes);
    /* The walk may have run Python code (a hash's __index__): the columns and the curve it reads
     * next must still be the ones checked above. */
    if (!self->bound || self->size != size || !curve_ready(curve)) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_RuntimeError, "the load table's columns were rebound during ttft()");
        PyBuffer_Release(&out);
        return NULL;
    }
    const double *tokens = row(self, L_PREFILL_TOKENS), *step = row(self, L_STEP_MS);
    const double *prefill = row(self, L_PREFILL_MS), *head_start = row(self, L_HEAD_START);
    const double *head_ms = row(self, L_HEAD_MS);
    double limit = maximum(isl - 1.0, 0.0); /* at least one token is always computed */
    double last_depth = -1.0, own = 0.0, cached = 0.0;
    for (Py_ssize_t s = 0; s < size; s++) {
        if (depth[s] != last_depth) {
            last_depth = depth[s];
            cached = minimum(last_depth * bs, limit);
            own = full - curve_at(curve, cached);
        }
        double unc = isl - cached;
        double steps = ceil((tokens[s] + unc) / budget) * step[s];
        double progress = maximum((now - head_start[s]) * 1000.0, 0.0);
        progress = minimum(progress, head_ms[s]);
        double backlog = maximum(prefill[s] - progress, 0.0);
        double onboard = host[s] * host_ms + disk[s] * disk_ms;
        ttft[s] = backlog + own + steps + onboard;
        uncached[s] = unc;
    }
    PyBuffer_Release(&out);
    Py_RETURN_NONE;
}

static Py_ssize_t LoadTable_len(LoadTableObject *self)
{
    return (Py_ssize_t)self->refs.count;
}

static PyMethodDef LoadTable_methods[] = {
    {"bind", (PyCFunction)LoadTable_bind, METH_O,
     "bind(columns): the per-worker figures now live in columns (LOAD_ROWS x size float64)."},
    {"add", (PyCFunction)(void (*)(void))LoadTable_add, METH_FASTCALL,
     "add(slot, hashes, prefill_tokens, prefill_ms, kv_tokens): a request routed to the slot."},
    {"end_prefill", (PyCFunction)(void (*)(void))LoadTable_end_prefill, METH_FASTCALL,
     "end_prefill(slot, prefill_tokens, prefill_ms): a request's first token arrived."},
    {"free", (PyCFunction)(void (*)(void))LoadTable_free, METH_FASTCALL,
     "free(slot, hashes, kv_tokens): a request ended."},
    {"leading_blocks", (PyCFunction)(void (*)(void))LoadTable_leading_blocks, METH_FASTCALL,
     "leading_blocks(hashes, out): out[slot] = leading blocks of hashes in use on the slot."},
    {"refresh", (PyCFunction)(void (*)(void))LoadTable_refresh, METH_FASTCALL,
     "refresh(slots, itl, f0, busy_prefill_tokens, busy_kv_tokens) -> flips: step time and free flag."},
    {"ttft", (PyCFunction)(void (*)(void))LoadTable_ttft, METH_FASTCALL,
     "ttft(index, hashes, out, prefill_curve, prompt_tokens, block_size, step_budget, now, full_ms, "
     "host_block_ms, disk_block_ms): leading blocks, those on the host and on disk, predicted time to first "
     "token and uncached tokens per worker."},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods LoadTable_as_sequence = {
    .sq_length = (lenfunc)LoadTable_len,
};

static PyTypeObject LoadTableType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "copse.router._native.LoadTable",
    .tp_doc = PyDoc_STR("LoadTable(block_size): per-worker in-flight figures (in bound columns) and the "
                        "blocks each worker's in-flight requests use."),
    .tp_basicsize = sizeof(LoadTableObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)LoadTable_init,
    .tp_dealloc = (destructor)LoadTable_dealloc,
    .tp_methods = LoadTable_methods,
    .tp_as_sequence = &LoadTable_as_sequence,
};

/* ---- the pick -------------------------------------------------------------------------------- */

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
    PyTypeObject *types[] = {&BlockIndexType, &CurveType, &GridType, &LoadTableType};
    const char *names[] = {"BlockIndex", "Curve", "Grid", "LoadTable"};
    for (size_t k = 0; k < sizeof(types) / sizeof(types[0]); k++) {
        if (PyType_Ready(types[k]) < 0)
            return NULL;
    }
    PyObject *module = PyModule_Create(&module_def);
    if (!module)
        return NULL;
    PyObject *rows = PyTuple_New(L_ROWS);
    if (!rows)
        goto failed;
    for (int k = 0; k < L_ROWS; k++) {
        PyObject *name = PyUnicode_FromString(load_row_names[k]);
        if (!name) {
            Py_DECREF(rows);
            goto failed;
        }
        PyTuple_SET_ITEM(rows, k, name);
    }
    if (PyModule_AddObject(module, "LOAD_ROWS", rows) < 0) {
        Py_DECREF(rows);
        goto failed;
    }
    if (PyModule_AddStringConstant(module, "SOURCE_SHA256", COPSE_NATIVE_SOURCE_SHA256) < 0)
        goto failed;
    for (size_t k = 0; k < sizeof(types) / sizeof(types[0]); k++) {
        if (PyModule_AddObjectRef(module, names[k], (PyObject *)types[k]) < 0)
            goto failed;
    }
    return module;
failed:
    Py_DECREF(module);
    return NULL;
}
