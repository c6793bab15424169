#include "util.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

double bk_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* the first unsigned number of file `path`; 0: none ("max", missing) */
static int read_u64_file(const char *path, uint64_t *v)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return 0;
    unsigned long long x;
    const int ok = fscanf(f, "%llu", &x) == 1;
    fclose(f);
    if (ok)
        *v = (uint64_t)x;
    return ok;
}

/* the value of `key` (a line "key N") in the memory.stat of dir; 0 when absent */
static uint64_t cg_stat(const char *dir, const char *key)
{
    char path[8500], line[256];
    snprintf(path, sizeof path, "%s/memory.stat", dir);
    FILE *f = fopen(path, "r");
    if (!f)
        return 0;
    const size_t kl = strlen(key);
    uint64_t v = 0;
    while (fgets(line, sizeof line, f)) {
        unsigned long long x;
        if (!strncmp(line, key, kl) && line[kl] == ' ' && sscanf(line + kl, "%llu", &x) == 1) {
            v = (uint64_t)x;
            break;
        }
    }
    fclose(f);
    return v;
}

/* what the memory limit of cgroup dir leaves (limit - usage + the file page
 * cache, which the kernel reclaims before it kills); 0: no limit there */
static int cg_room(const char *dir, int v2, uint64_t *room)
{
    char path[8500];
    uint64_t lim = 0, use = 0;
    snprintf(path, sizeof path, "%s/%s", dir, v2 ? "memory.max" : "memory.limit_in_bytes");
    /* (v2 "max" and v1's page-rounded LONG_MAX: no limit) */
    if (!read_u64_file(path, &lim) || lim >= ((uint64_t)1 << 62))
        return 0;
    snprintf(path, sizeof path, "%s/%s", dir, v2 ? "memory.current" : "memory.usage_in_bytes");
    if (!read_u64_file(path, &use))
        return 0;
    /* the page cache on the file LRU lists, active and inactive (as
     * MemAvailable counts it; shared memory / tmpfs is on the anon lists and
     * stays used): the kernel reclaims it before the group's OOM killer, and
     * the planners subtract the checkpoint's own pages themselves */
    uint64_t cache = cg_stat(dir, v2 ? "inactive_file" : "total_inactive_file") +
                     cg_stat(dir, v2 ? "active_file" : "total_active_file");
    if (cache > use)
        cache = use;
    use -= cache;
    *room = lim > use ? lim - use : 0;
    return 1;
}

/* The least room of the memory limits from the process's cgroup up to the
 * root of the hierarchy mounted at `root` (cgroup v2: root itself; v1: its
 * "memory" directory); the group's path from `self` (/proc/self/cgroup).
 * A path not under the mount (a container's namespaced view): the mount's
 * root only. 0 when no limit is found. */
static int cg_avail(const char *self, const char *root, uint64_t *out)
{
    FILE *f = fopen(self, "r");
    if (!f)
        return 0;
    char line[4096], rel[4096] = "";
    int v2 = -1;
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = '\0';
        char *c1 = strchr(line, ':'), *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
        if (!c2)
            continue;
        *c2 = '\0';
        const char *ctl = c1 + 1, *path = c2 + 1;
        int mem = 0;
        for (const char *p = ctl; *p;) { /* v1: "memory" among the controllers */
            const size_t n = strcspn(p, ",");
            if (n == 6 && !strncmp(p, "memory", 6))
                mem = 1;
            p += n + (p[n] == ',');
        }
        if (mem) {
            v2 = 0;
            snprintf(rel, sizeof rel, "%s", path);
            break;
        }
        if (line[0] == '0' && c1 == line + 1 && !*ctl) { /* v2: "0::/path" */
            v2 = 1;
            snprintf(rel, sizeof rel, "%s", path);
        }
    }
    fclose(f);
    if (v2 < 0)
        return 0;
    char base[4200], dir[8400];
    snprintf(base, sizeof base, v2 ? "%s" : "%s/memory", root);
    snprintf(dir, sizeof dir, "%s%s", base, rel[0] == '/' && rel[1] ? rel : "");
    struct stat sb;
    if (stat(dir, &sb) != 0 || !S_ISDIR(sb.st_mode) || strstr(rel, "/.."))
        snprintf(dir, sizeof dir, "%s", base);
    int found = 0;
    uint64_t best = 0;
    for (;;) {
        uint64_t r;
        if (cg_room(dir, v2, &r) && (!found || r < best)) {
            best = r;
            found = 1;
        }
        if (strlen(dir) <= strlen(base))
            break;
        char *slash = strrchr(dir, '/');
        if (!slash || slash < dir + strlen(base))
            break;
        *slash = '\0';
    }
    if (found)
        *out = best;
    return found;
}

uint64_t bk__host_avail_bytes_at(const char *meminfo, const char *self_cgroup,
                                 const char *cgroup_root)
{
    uint64_t kb = 0, avail = 0;
    FILE *f = fopen(meminfo, "r");
    if (f) {
        char line[256];
        unsigned long long v;
        while (fgets(line, sizeof line, f))
            if (sscanf(line, "MemAvailable: %llu kB", &v) == 1) {
                kb = (uint64_t)v;
                break;
            }
        fclose(f);
    }
    if (kb && kb < ((uint64_t)1 << 53))
        avail = kb * 1024;
    else {
        long pages = sysconf(_SC_AVPHYS_PAGES), ps = sysconf(_SC_PAGESIZE);
        avail = pages > 0 && ps > 0 ? (uint64_t)pages * (uint64_t)ps : 0;
    }
    /* a container or a batch job's memory limit (cgroups): the host's
     * MemAvailable does not see it, and going past it wakes the OOM killer */
    uint64_t cg;
    if (self_cgroup && cgroup_root && cg_avail(self_cgroup, cgroup_root, &cg)) {
        if (!avail || cg < avail)
            avail = cg ? cg : 1; /* (a limit reached: 1 byte, not "unknown") */
    }
    return avail;
}

uint64_t bk_host_avail_bytes(void)
{
    return bk__host_avail_bytes_at("/proc/meminfo", "/proc/self/cgroup", "/sys/fs/cgroup");
}

/* ------------------------------------------------------------ profiling */

#define BK_PROF_MAX 96
static struct {
    pthread_mutex_t mu;
    int n;
    const char *key[BK_PROF_MAX];
    double sum[BK_PROF_MAX];
    long count[BK_PROF_MAX];
} g_prof = {PTHREAD_MUTEX_INITIALIZER, 0, {0}, {0}, {0}};

int bk_prof_on(void)
{
    static int on = -1;
    if (on < 0) {
        const char *e = getenv("BK_PROFILE");
        on = e && e[0] && strcmp(e, "0") != 0;
    }
    return on;
}

void bk_prof_add(const char *key, double seconds)
{
    if (!bk_prof_on())
        return;
    pthread_mutex_lock(&g_prof.mu);
    int i = 0;
    while (i < g_prof.n && strcmp(g_prof.key[i], key) != 0)
        i++;
    if (i == g_prof.n && g_prof.n < BK_PROF_MAX)
        g_prof.key[g_prof.n++] = key;
    if (i < g_prof.n) {
        g_prof.sum[i] += seconds;
        g_prof.count[i]++;
    }
    pthread_mutex_unlock(&g_prof.mu);
}

void bk_prof_mark(double *t, const char *key)
{
    if (!bk_prof_on())
        return;
    const double now = bk_now();
    bk_prof_add(key, now - *t);
    *t = now;
}

void bk_prof_print(void)
{
    if (!bk_prof_on())
        return;
    pthread_mutex_lock(&g_prof.mu);
    fprintf(stderr, "profile (BK_PROFILE): key, seconds, count\n");
    for (int i = 0; i < g_prof.n; i++)
        fprintf(stderr, "profile %-28s %10.3f %8ld\n", g_prof.key[i], g_prof.sum[i],
                g_prof.count[i]);
    pthread_mutex_unlock(&g_prof.mu);
}

void *bk_alloc(size_t n, size_t size)
{
    size_t bytes;
    if (__builtin_mul_overflow(n, size, &bytes))
        return NULL;
    if (bytes == 0)
        bytes = 1;
    /* round up to the alignment, as aligned_alloc requires */
    if (bytes > SIZE_MAX - 63)
        return NULL;
    bytes = (bytes + 63) & ~(size_t)63;
    return aligned_alloc(64, bytes);
}

void *bk_calloc(size_t n, size_t size)
{
    void *p = bk_alloc(n, size);
    if (p)
        memset(p, 0, n * size > 0 ? n * size : 1);
    return p;
}

const char *bk_file_kind(mode_t mode)
{
    if (S_ISREG(mode))
        return "a regular file";
    if (S_ISDIR(mode))
        return "a folder";
    if (S_ISFIFO(mode))
        return "a FIFO (named pipe)";
    if (S_ISCHR(mode) || S_ISBLK(mode))
        return "a device";
    if (S_ISSOCK(mode))
        return "a socket";
    return "not a regular file";
}

int bk_open_regular(const char *path, struct stat *sb)
{
    /* O_NONBLOCK: opening a FIFO must not wait for a writer */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) {
        bk_error(BK_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
        return -1;
    }
    struct stat tmp;
    if (!sb)
        sb = &tmp;
    if (fstat(fd, sb) != 0) {
        int e = errno;
        close(fd);
        bk_error(BK_ERR_IO, "%s: cannot stat: %s", path, strerror(e));
        return -1;
    }
    if (!S_ISREG(sb->st_mode)) {
        close(fd);
        bk_error(BK_ERR_IO, "%s: is %s, not a regular file", path, bk_file_kind(sb->st_mode));
        return -1;
    }
    int fl = fcntl(fd, F_GETFL);
    if (fl >= 0)
        fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
    return fd;
}

bk_status bk_read_file(const char *path, size_t max_bytes, char **buf, size_t *len)
{
    *buf = NULL;
    if (len)
        *len = 0;
    struct stat st;
    int fd = bk_open_regular(path, &st);
    if (fd < 0)
        return BK_ERR_IO;
    FILE *f = fdopen(fd, "rb");
    if (!f) {
        close(fd);
        return bk_error(BK_ERR_NOMEM, "%s: cannot open: %s", path, strerror(errno));
    }
    if ((uint64_t)st.st_size > max_bytes) {
        fclose(f);
        return bk_error(BK_ERR_IO, "%s: file too large (%lld bytes, limit %zu)", path,
                        (long long)st.st_size, max_bytes);
    }
    size_t n = (size_t)st.st_size;
    char *b = malloc(n + 1);
    if (!b) {
        fclose(f);
        return bk_error(BK_ERR_NOMEM, "%s: out of memory reading %zu bytes", path, n);
    }
    if (n && fread(b, 1, n, f) != n) {
        const int e = ferror(f) ? errno : 0;
        free(b);
        fclose(f);
        return bk_error(BK_ERR_IO, "%s: read failed: %s", path,
                        e ? strerror(e) : "the file became shorter while it was read");
    }
    fclose(f);
    b[n] = '\0';
    *buf = b;
    if (len)
        *len = n;
    return BK_OK;
}

bk_status bk_read_json(const char *path, size_t max_bytes, struct cJSON **root)
{
    char *text = NULL;
    size_t len = 0;
    *root = NULL;
    bk_status st = bk_read_file(path, max_bytes, &text, &len);
    if (st != BK_OK)
        return st;
    *root = cJSON_ParseWithLength(text, len);
    free(text);
    return BK_OK;
}

const char *bk_json_kind(const struct cJSON *v, const char *absent)
{
    static const struct {
        cJSON_bool (*is)(const cJSON *const);
        const char *name;
    } kinds[] = {{cJSON_IsNull, "null"},     {cJSON_IsBool, "a boolean"},
                 {cJSON_IsNumber, "a number"}, {cJSON_IsString, "a string"},
                 {cJSON_IsArray, "an array"},  {cJSON_IsObject, "an object"}};
    if (!v)
        return absent;
    for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++)
        if (kinds[i].is(v))
            return kinds[i].name;
    return "an invalid value";
}

bk_status bk_path_join(char *dst, size_t cap, const char *a, const char *b)
{
    size_t la = strlen(a);
    int n;
    if (la == 0)
        n = snprintf(dst, cap, "%s", b);
    else if (a[la - 1] == '/')
        n = snprintf(dst, cap, "%s%s", a, b);
    else
        n = snprintf(dst, cap, "%s/%s", a, b);
    if (n < 0 || (size_t)n >= cap)
        return bk_error(BK_ERR_INVALID_ARG, "path too long: %s/%s", a, b);
    return BK_OK;
}

int bk_is_dir(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0 && S_ISDIR(st.st_mode);
}

int bk_is_file(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

int bk_ends_with(const char *name, const char *suffix)
{
    size_t ln = strlen(name), ls = strlen(suffix);
    return ln >= ls && memcmp(name + ln - ls, suffix, ls) == 0;
}

bk_status bk_mkdir_p(const char *path)
{
    char tmp[4096];
    size_t len = strlen(path);
    if (len == 0 || len >= sizeof tmp)
        return bk_error(BK_ERR_INVALID_ARG, "bad directory path '%s'", path);
    memcpy(tmp, path, len + 1);
    for (char *p = tmp + 1; *p; p++) {
        if (*p == '/') {
            *p = '\0';
            if (mkdir(tmp, 0777) != 0 && errno != EEXIST)
                return bk_error(BK_ERR_WRITE, "%s: cannot create directory: %s", tmp,
                                strerror(errno));
            *p = '/';
        }
    }
    if (mkdir(tmp, 0777) != 0 && errno != EEXIST)
        return bk_error(BK_ERR_WRITE, "%s: cannot create directory: %s", tmp, strerror(errno));
    if (!bk_is_dir(tmp))
        return bk_error(BK_ERR_WRITE, "%s: exists and is not a directory", tmp);
    return BK_OK;
}

void bk_remove_tree(const char *path)
{
    struct stat st;
    if (lstat(path, &st) != 0)
        return;
    if (S_ISDIR(st.st_mode)) {
        DIR *d = opendir(path);
        if (d) {
            struct dirent *e;
            while ((e = readdir(d)) != NULL) {
                if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
                    continue;
                char sub[4096];
                if (bk_path_join(sub, sizeof sub, path, e->d_name) == BK_OK)
                    bk_remove_tree(sub);
            }
            closedir(d);
        }
        rmdir(path);
    } else {
        unlink(path);
    }
}

bk_status bk_write_file_atomic(const char *path, const void *data, size_t len)
{
    char tmp[4096];
    int n = snprintf(tmp, sizeof tmp, "%s.tmp.XXXXXX", path);
    if (n < 0 || (size_t)n >= sizeof tmp)
        return bk_error(BK_ERR_INVALID_ARG, "path too long: %s", path);
    int fd = mkstemp(tmp);
    if (fd < 0)
        return bk_error(BK_ERR_WRITE, "%s: cannot create temporary file: %s", path,
                        strerror(errno));
    const char *p = data;
    size_t left = len;
    while (left > 0) {
        ssize_t w = write(fd, p, left);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            int e = errno;
            close(fd);
            unlink(tmp);
            return bk_error(BK_ERR_WRITE, "%s: write failed: %s", path, strerror(e));
        }
        p += w;
        left -= (size_t)w;
    }
    if (fsync(fd) != 0) {
        int e = errno;
        close(fd);
        unlink(tmp);
        return bk_error(BK_ERR_WRITE, "%s: fsync failed: %s", path, strerror(e));
    }
    fchmod(fd, 0644);
    if (close(fd) != 0) {
        unlink(tmp);
        return bk_error(BK_ERR_WRITE, "%s: close failed", path);
    }
    if (rename(tmp, path) != 0) {
        int e = errno;
        unlink(tmp);
        return bk_error(BK_ERR_WRITE, "%s: rename failed: %s", path, strerror(e));
    }
    return BK_OK;
}

bk_status bk_copy_file(const char *src, const char *dst)
{
    FILE *in = fopen(src, "rb");
    if (!in)
        return bk_error(BK_ERR_IO, "%s: cannot open: %s", src, strerror(errno));
    FILE *out = fopen(dst, "wb");
    if (!out) {
        fclose(in);
        return bk_error(BK_ERR_WRITE, "%s: cannot create: %s", dst, strerror(errno));
    }
    char buf[1 << 16];
    size_t r;
    bk_status st = BK_OK;
    while ((r = fread(buf, 1, sizeof buf, in)) > 0) {
        if (fwrite(buf, 1, r, out) != r) {
            st = bk_error(BK_ERR_WRITE, "%s: write failed: %s", dst, strerror(errno));
            break;
        }
    }
    if (ferror(in))
        st = bk_error(BK_ERR_IO, "%s: read failed: %s", src, strerror(errno));
    fclose(in);
    /* buffered data reach the file here: a full disk shows up at the close */
    if (fclose(out) != 0 && st == BK_OK)
        st = bk_error(BK_ERR_WRITE, "%s: write failed: %s", dst, strerror(errno));
    if (st != BK_OK)
        unlink(dst);
    return st;
}

static inline uint64_t rotl(uint64_t x, int k)
{
    return (x << k) | (x >> (64 - k));
}

void bk_rng_seed(bk_rng *r, uint64_t seed)
{
    /* splitmix64 to fill the state */
    for (int i = 0; i < 4; i++) {
        uint64_t z = (seed += 0x9e3779b97f4a7c15ULL);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
        r->s[i] = z ^ (z >> 31);
    }
}

uint64_t bk_rng_next(bk_rng *r)
{
    uint64_t *s = r->s;
    uint64_t result = rotl(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

double bk_rng_uniform(bk_rng *r)
{
    return (double)(bk_rng_next(r) >> 11) * 0x1.0p-53;
}

double bk_rng_normal(bk_rng *r)
{
    double u1 = bk_rng_uniform(r), u2 = bk_rng_uniform(r);
    if (u1 < 1e-300)
        u1 = 1e-300;
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

/* Lexical checks cJSON does not make: raw control characters are not allowed
 * inside strings, and outside them only as whitespace (TAB, LF, CR). Also finds
 * the escape \u0000, which cJSON would silently cut a string at (a name with a
 * NUL in it cannot be represented in bakron's C strings).
 * Returns the offset of the first problem (or n) and its kind in *kind:
 * 1 control character in a string, 2 outside strings, 3 \u0000. */
size_t bk_json_problem_at(const unsigned char *s, size_t n, int *kind)
{
    int in_str = 0, esc = 0;
    for (size_t i = 0; i < n; i++) {
        unsigned c = s[i];
        if (in_str) {
            if (esc) {
                esc = 0;
                if (c == 'u' && n - i > 4 && !memcmp(s + i + 1, "0000", 4)) {
                    *kind = 3;
                    return i - 1;
                }
            } else if (c == '\\') {
                esc = 1;
            } else if (c == '"') {
                in_str = 0;
            } else if (c < 0x20) {
                *kind = 1;
                return i;
            }
        } else if (c == '"') {
            in_str = 1;
        } else if (c < 0x20 && c != '\t' && c != '\n' && c != '\r') {
            *kind = 2;
            return i;
        }
    }
    return n;
}

bk_status bk_json_check_text(const char *text, size_t len, const char *label, bk_status code)
{
    int kind = 0;
    size_t bad = bk_json_problem_at((const unsigned char *)text, len, &kind);
    if (bad == len)
        return BK_OK;
    if (kind == 3)
        return bk_error(code,
                        "%s: a JSON string holds the escape \\u0000 at byte %zu (a name or value "
                        "with a NUL character is refused, not cut short)",
                        label, bad);
    return bk_error(code, "%s: not valid JSON (raw control character 0x%02x %s at byte %zu)",
                    label, (unsigned char)text[bad],
                    kind == 1 ? "inside a string" : "between tokens", bad);
}

static int cmp_names(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

int bk_list_sorted(const char *dir, int (*keep)(const char *name, void *user), void *user,
                   char ***names_out, size_t *n_out)
{
    *names_out = NULL;
    *n_out = 0;
    DIR *d = opendir(dir);
    if (!d)
        return -1;
    char **names = NULL;
    size_t n = 0, cap = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (!keep(e->d_name, user))
            continue;
        if (n == cap) {
            size_t nc = cap ? 2 * cap : 16;
            char **nn = realloc(names, nc * sizeof *nn);
            if (!nn)
                break;
            names = nn;
            cap = nc;
        }
        if (!(names[n] = strdup(e->d_name)))
            break;
        n++;
    }
    closedir(d);
    if (n > 1)
        qsort(names, n, sizeof *names, cmp_names);
    *names_out = names;
    *n_out = n;
    return 0;
}
