/* Output folders: safety checks, lock, leftovers, atomic commit (outdir.h). */
#include "outdir.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>

#include "util.h"

#define MAX_INPUTS 4096

/* ------------------------------------------------------------ paths */

static bk_status too_long(const char *path)
{
    return bk_error(BK_ERR_USAGE, "path too long: %.200s", path);
}

bk_status bk_path_canonical(const char *path, char *out, size_t cap)
{
    if (!path || !path[0])
        return bk_error(BK_ERR_USAGE, "empty path");
    char cur[BK_PATH_MAX];
    if (path[0] == '/') {
        cur[0] = '\0';
    } else if (!realpath(".", cur)) {
        return bk_error(BK_ERR_IO, "cannot resolve the current folder: %s", strerror(errno));
    }
    if (!strcmp(cur, "/"))
        cur[0] = '\0'; /* cur holds "" for the root, else "/a/b" */
    const char *p = path;
    while (*p) {
        while (*p == '/')
            p++;
        if (!*p)
            break;
        const char *e = strchr(p, '/');
        size_t n = e ? (size_t)(e - p) : strlen(p);
        if (n == 1 && p[0] == '.') {
            /* nothing */
        } else if (n == 2 && p[0] == '.' && p[1] == '.') {
            char *slash = strrchr(cur, '/');
            if (slash)
                *slash = '\0'; /* cur has no symbolic links left: ".." is its parent */
        } else {
            size_t lc = strlen(cur);
            if (lc + 1 + n + 1 > sizeof cur)
                return too_long(path);
            cur[lc] = '/';
            memcpy(cur + lc + 1, p, n);
            cur[lc + 1 + n] = '\0';
            struct stat sb;
            if (lstat(cur, &sb) == 0) {
                char r[PATH_MAX];
                if (!realpath(cur, r)) {
                    /* a dangling link or no permission: keep the lexical form */
                } else {
                    if (strlen(r) + 1 > sizeof cur)
                        return too_long(path);
                    strcpy(cur, strcmp(r, "/") ? r : "");
                }
            }
        }
        p += n;
    }
    const char *res = cur[0] ? cur : "/";
    if (strlen(res) + 1 > cap)
        return too_long(path);
    strcpy(out, res);
    return BK_OK;
}

/* a is b, or inside b (both canonical) */
static int within(const char *a, const char *b)
{
    if (!strcmp(b, "/"))
        return 1;
    size_t lb = strlen(b);
    return !strncmp(a, b, lb) && (a[lb] == '\0' || a[lb] == '/');
}

static int dir_is_empty(const char *path)
{
    DIR *d = opendir(path);
    if (!d)
        return 1;
    struct dirent *e;
    int empty = 1;
    while ((e = readdir(d)) != NULL) {
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) {
            empty = 0;
            break;
        }
    }
    closedir(d);
    return empty;
}

static void fsync_path(const char *path, int dir)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC | (dir ? O_DIRECTORY : 0));
    if (fd >= 0) {
        fsync(fd);
        close(fd);
    }
}

static void parent_of(const char *canon, char *out, size_t cap)
{
    snprintf(out, cap, "%s", canon);
    char *slash = strrchr(out, '/');
    if (slash == out)
        out[1] = '\0';
    else if (slash)
        *slash = '\0';
}

static void note(const bk_outdir *d, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
static void note(const bk_outdir *d, const char *fmt, ...)
{
    char msg[1400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (d->note)
        d->note(d->user, msg);
    else { /* (paths: escaped as in the error messages) */
        char esc[4 * sizeof msg];
        bk_escape_message(msg, esc, sizeof esc);
        fprintf(stderr, "bakron: %s\n", esc);
    }
}

/* Test hooks (tests/test_outdir.sh): BK_FAULT_KILL_AT=NAME kills the process
 * at that point of the commit; BK_FAULT_NO_EXCHANGE=1 takes the two-rename
 * path that filesystems without RENAME_EXCHANGE use. */
static void kill_point(const char *name)
{
    const char *e = getenv("BK_FAULT_KILL_AT");
    if (e && !strcmp(e, name))
        raise(SIGKILL);
}

/* ------------------------------------------------------------- checks */

typedef struct inputs {
    char (*p)[BK_PATH_MAX];
    const char **given;
    int n;
} inputs;

/* Room for MAX_INPUTS inputs. */
static bk_status inputs_alloc(inputs *in)
{
    in->p = malloc(sizeof *in->p * MAX_INPUTS);
    in->given = malloc(sizeof *in->given * MAX_INPUTS);
    if (!in->p || !in->given) {
        free(in->p);
        free(in->given);
        return bk_error(BK_ERR_NOMEM, "out of memory");
    }
    return BK_OK;
}

static bk_status add_input(inputs *in, const char *canon, const char *given)
{
    if (in->n >= MAX_INPUTS)
        return BK_OK;
    snprintf(in->p[in->n], BK_PATH_MAX, "%s", canon);
    in->given[in->n] = given;
    in->n++;
    return BK_OK;
}

/* The inputs, canonical; for a folder also the targets of the symbolic links
 * in it (a Hugging Face cache folder links its files to blobs elsewhere). */
static bk_status collect_inputs(const char *const *list, inputs *in)
{
    bk_status st;
    for (int i = 0; list && list[i]; i++) {
        if (!list[i][0])
            continue;
        char c[BK_PATH_MAX];
        if ((st = bk_path_canonical(list[i], c, sizeof c)) != BK_OK)
            return st == BK_ERR_USAGE ? BK_OK : st;
        add_input(in, c, list[i]);
        if (!bk_is_dir(list[i]))
            continue;
        DIR *d = opendir(list[i]);
        if (!d)
            continue;
        struct dirent *e;
        while ((e = readdir(d)) != NULL) {
            char sub[BK_PATH_MAX], r[PATH_MAX];
            struct stat sb;
            if (e->d_name[0] == '.' || bk_path_join(sub, sizeof sub, list[i], e->d_name) != BK_OK)
                continue;
            if (lstat(sub, &sb) == 0 && S_ISLNK(sb.st_mode) && realpath(sub, r))
                add_input(in, r, list[i]);
        }
        closedir(d);
    }
    return BK_OK;
}

static bk_status check_safe(bk_outdir *d, const bk_outdir_spec *s, const inputs *in)
{
    const char *out = d->final;
    if (!strcmp(d->canon, "/"))
        return bk_error(BK_ERR_USAGE, "--out %s: is the root folder", out);
    char cwd[PATH_MAX];
    if (!realpath(".", cwd))
        return bk_error(BK_ERR_IO, "cannot resolve the current folder: %s", strerror(errno));
    if (within(cwd, d->canon))
        return bk_error(BK_ERR_USAGE,
                        "--out %s: is the current folder or one of its parents (%s); the output "
                        "folder is replaced as a whole, give a new or dedicated folder",
                        out, d->canon);
    for (int i = 0; i < in->n; i++) {
        if (!strcmp(in->p[i], d->canon))
            return bk_error(BK_ERR_USAGE,
                            "--out %s: is %s, which this %s run reads; give a separate output "
                            "folder",
                            out, in->given[i], s->what);
        if (within(in->p[i], d->canon))
            return bk_error(BK_ERR_USAGE,
                            "--out %s: holds %s, which this %s run reads (%s); give a separate "
                            "output folder",
                            out, in->given[i], s->what, in->p[i]);
        if (within(d->canon, in->p[i]))
            return bk_error(BK_ERR_USAGE,
                            "--out %s: is inside %s, which this %s run reads; give an output "
                            "folder outside it",
                            out, in->given[i], s->what);
    }
    return BK_OK;
}

/* -------------------------------------------------------------- lock */

static bk_status take_lock(bk_outdir *d)
{
    for (int tries = 0; tries < 8; tries++) {
        int fd = open(d->lock, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
        if (fd < 0)
            return bk_error(BK_ERR_WRITE, "%s: cannot create the lock file: %s", d->lock,
                            strerror(errno));
        if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
            int e = errno;
            char who[256] = "";
            ssize_t n = pread(fd, who, sizeof who - 1, 0);
            close(fd);
            if (e != EWOULDBLOCK)
                return bk_error(BK_ERR_WRITE, "%s: cannot lock: %s", d->lock, strerror(e));
            who[n > 0 ? n : 0] = '\0';
            for (char *p = who; *p; p++)
                if (*p == '\n' || (unsigned char)*p < 0x20)
                    *p = ' ';
            for (size_t k = strlen(who); k > 0 && who[k - 1] == ' '; k--)
                who[k - 1] = '\0';
            return bk_error(BK_ERR_BUSY,
                            "--out %s: another bakron run is writing this output folder (%s; lock "
                            "file %s); wait for it or choose another --out",
                            d->final, who[0] ? who : "unknown process", d->lock);
        }
        /* the holder before us may have removed the file after we opened it */
        struct stat a, b;
        if (fstat(fd, &a) == 0 && stat(d->lock, &b) == 0 && a.st_dev == b.st_dev &&
            a.st_ino == b.st_ino) {
            char old[256] = "";
            ssize_t n = pread(fd, old, sizeof old - 1, 0);
            old[n > 0 ? n : 0] = '\0';
            for (char *p = old; *p; p++)
                if (*p == '\n' || (unsigned char)*p < 0x20)
                    *p = ' ';
            for (size_t k = strlen(old); k > 0 && old[k - 1] == ' '; k--)
                old[k - 1] = '\0';
            if (old[0])
                note(d, "cleared a stale lock %s (%s): that run ended without releasing it",
                     d->lock, old);
            char host[256] = "?";
            gethostname(host, sizeof host - 1);
            host[sizeof host - 1] = '\0';
            char when[64] = "";
            time_t now = time(NULL);
            struct tm tm;
            if (gmtime_r(&now, &tm))
                strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%SZ", &tm);
            char line[600];
            int len = snprintf(line, sizeof line, "pid %ld on %s, started %s\n", (long)getpid(),
                               host, when);
            if (ftruncate(fd, 0) != 0 || pwrite(fd, line, (size_t)len, 0) != len) {
                int e = errno;
                unlink(d->lock);
                close(fd);
                return bk_error(BK_ERR_WRITE, "%s: cannot write the lock file: %s", d->lock,
                                strerror(e));
            }
            d->lock_fd = fd;
            return BK_OK;
        }
        close(fd);
    }
    return bk_error(BK_ERR_BUSY, "%s: the lock file keeps being replaced", d->lock);
}

static void release_lock(bk_outdir *d)
{
    if (d->lock_fd < 0 || !d->lock[0])
        return;
    unlink(d->lock); /* while holding it: a waiter that opened it retries */
    close(d->lock_fd);
    d->lock_fd = -1;
}

/* ---------------------------------------------------------- leftovers */

/* NAME.tmp-PID / NAME.old-PID: kind 't' / 'o' and the pid, else 0. */
static int leftover_kind(const char *entry, const char *base, long *pid)
{
    size_t lb = strlen(base);
    if (strncmp(entry, base, lb) != 0)
        return 0;
    const char *r = entry + lb;
    int kind = !strncmp(r, ".tmp-", 5) ? 't' : !strncmp(r, ".old-", 5) ? 'o' : 0;
    if (!kind)
        return 0;
    r += 5;
    if (!*r)
        return 0;
    for (const char *q = r; *q; q++)
        if (*q < '0' || *q > '9')
            return 0;
    char *end;
    errno = 0;
    long v = strtol(r, &end, 10);
    if (errno || *end || v <= 0)
        return 0;
    *pid = v;
    return kind;
}

static int pid_alive(long pid)
{
    if (pid == (long)getpid())
        return 0; /* a dead run's pid, reused by us */
    return kill((pid_t)pid, 0) == 0 || errno == EPERM;
}

typedef struct leftover_want {
    const char *base;
} leftover_want;

static int is_leftover(const char *name, void *user)
{
    long pid;
    return leftover_kind(name, ((leftover_want *)user)->base, &pid) != 0;
}

static bk_status clean_leftovers(bk_outdir *d, const bk_outdir_spec *s, const inputs *in,
                                 const char *parent, int *adopted)
{
    const char *base = strrchr(d->canon, '/') + 1;
    char **names = NULL;
    size_t n = 0;
    leftover_want want = {base};
    if (bk_list_sorted(parent, is_leftover, &want, &names, &n) != 0)
        return bk_error(BK_ERR_IO, "%s: cannot list: %s", parent, strerror(errno));
    /* old outputs first: a kill between "old output aside" and "new output
     * in" left no output: put the old one back */
    for (int pass = 0; pass < 2; pass++) {
        for (size_t i = 0; i < n; i++) {
            long pid;
            int kind = leftover_kind(names[i], base, &pid);
            if ((pass == 0) != (kind == 'o'))
                continue;
            char path[BK_PATH_MAX], shown[BK_PATH_MAX + 64];
            if (bk_path_join(path, sizeof path, parent, names[i]) != BK_OK)
                continue;
            snprintf(shown, sizeof shown, "%s.%s-%ld", d->final, kind == 'o' ? "old" : "tmp", pid);
            if (pid_alive(pid)) {
                note(d, "left %s in place: process %ld is running (not a bakron run holding "
                        "the lock of this output)", shown, pid);
                continue;
            }
            int used = 0;
            for (int k = 0; k < in->n; k++)
                if (within(in->p[k], path))
                    used = 1;
            if (used) {
                note(d, "left %s in place: this run reads from it", shown);
                continue;
            }
            struct stat sb;
            if (kind == 'o' && lstat(d->canon, &sb) != 0 && errno == ENOENT) {
                if (rename(path, d->canon) == 0) {
                    note(d, "restored %s from %s (a run was killed while replacing it)", d->final,
                         shown);
                    continue;
                }
            }
            if (kind == 't' && s->resume && adopted && !*adopted && s->resumable &&
                s->resumable(s->resumable_user, path)) {
                if (rename(path, d->work) == 0) {
                    *adopted = 1; /* (the caller says what it keeps of it) */
                    continue;
                }
            }
            if (kind == 't' && !s->resume && s->resumable && s->resumable(s->resumable_user, path))
                note(d, "%s holds an interrupted run that --resume would continue; starting "
                        "over", shown);
            bk_remove_tree(path);
            if (lstat(path, &sb) == 0)
                note(d, "could not remove %s (left by a killed run)", shown);
            else
                note(d, "removed %s, left by a killed run", shown);
        }
    }
    for (size_t i = 0; i < n; i++)
        free(names[i]);
    free(names);
    return BK_OK;
}

/* --------------------------------------------------------------- API */

/* --out: d->final (trailing slashes dropped) and d->canon; refused when it
 * is a symbolic link or something other than a folder. *exists: it exists. */
/* An existing OUT (empty, or non-empty with --overwrite) is swapped out at
 * the commit and deleted: without write access to a non-empty OUT its files
 * cannot go (the new output would go in and OUT.old-PID stay beside it), and
 * in a folder with the sticky bit (/tmp) another user's OUT cannot be renamed
 * at all (the commit would fail after the work). Checked before the work. */
static bk_status old_replaceable(const bk_outdir *d)
{
    struct stat fsb, psb;
    char parent[BK_PATH_MAX];
    parent_of(d->canon, parent, sizeof parent);
    if (lstat(d->final, &fsb) != 0 || stat(parent, &psb) != 0)
        return BK_OK; /* gone meanwhile: nothing to replace */
    const uid_t me = geteuid();
    if ((psb.st_mode & S_ISVTX) && me != 0 && fsb.st_uid != me && psb.st_uid != me)
        return bk_error(BK_ERR_WRITE,
                        "--out %s: cannot be replaced: it belongs to another user (uid %lu) "
                        "in %s, a folder with the sticky bit",
                        d->final, (unsigned long)fsb.st_uid, parent);
    if (!dir_is_empty(d->final) && access(d->final, W_OK | X_OK) != 0)
        return bk_error(BK_ERR_WRITE,
                        "--out %s: --overwrite cannot delete the old output's files: %s",
                        d->final, strerror(errno));
    return BK_OK;
}

static bk_status out_paths(bk_outdir *d, const char *out, int *exists)
{
    *exists = 0;
    if (!out || !out[0])
        return bk_error(BK_ERR_USAGE, "--out: empty path");
    size_t len = strlen(out);
    while (len > 1 && out[len - 1] == '/')
        len--;
    if (len + 32 >= sizeof d->final)
        return too_long(out);
    memcpy(d->final, out, len);
    d->final[len] = '\0';
    /* the work folder NAME.tmp-PID and the lock .NAME.lock sit next to it:
     * a name that fits but leaves them no room fails only at their creation */
    const char *base = strrchr(d->final, '/');
    base = base ? base + 1 : d->final;
    const size_t max_base = NAME_MAX - strlen(".tmp-") - 7; /* pid_max <= 4194304 */
    if (strlen(base) > max_base)
        return bk_error(BK_ERR_USAGE,
                        "--out %s: the folder name is %zu bytes, at most %zu (its work folder "
                        "NAME.tmp-PID must fit the file system's %d-byte names)",
                        d->final, strlen(base), max_base, NAME_MAX);
    struct stat sb;
    *exists = lstat(d->final, &sb) == 0;
    if (*exists && S_ISLNK(sb.st_mode))
        return bk_error(BK_ERR_USAGE,
                        "--out %s: is a symbolic link; give the folder itself (the output "
                        "folder is replaced as a whole)",
                        d->final);
    if (*exists && !S_ISDIR(sb.st_mode))
        return bk_error(BK_ERR_USAGE, "--out %s: exists and is %s, not a folder", d->final,
                        bk_file_kind(sb.st_mode));
    return bk_path_canonical(d->final, d->canon, sizeof d->canon);
}

bk_status bk_outdir_open(bk_outdir *d, const bk_outdir_spec *s, int *adopted)
{
    memset(d, 0, sizeof *d);
    d->lock_fd = -1;
    d->overwrite = s->overwrite;
    d->note = s->note;
    d->user = s->user;
    if (adopted)
        *adopted = 0;
    struct stat sb;
    int exists;
    bk_status st = out_paths(d, s->out, &exists);
    if (st != BK_OK)
        return st;
    if (!strcmp(d->canon, "/"))
        return bk_error(BK_ERR_USAGE, "--out %s: is the root folder", d->final);
    const char *base = strrchr(d->canon, '/');

    inputs in = {0};
    if (inputs_alloc(&in) != BK_OK)
        return BK_ERR_NOMEM;
    char parent[BK_PATH_MAX];
    if ((st = collect_inputs(s->inputs, &in)) != BK_OK || (st = check_safe(d, s, &in)) != BK_OK)
        goto fail;

    /* names next to the output (the work folder in the same filesystem) */
    parent_of(d->canon, parent, sizeof parent);
    if ((st = bk_mkdir_p(parent)) != BK_OK)
        goto fail;
    int n1 = snprintf(d->work, sizeof d->work, "%s.tmp-%ld", d->final, (long)getpid());
    int n2 = snprintf(d->lock, sizeof d->lock, "%s/.%s.lock", parent, base + 1);
    if (n1 < 0 || (size_t)n1 >= sizeof d->work || n2 < 0 || (size_t)n2 >= sizeof d->lock) {
        st = too_long(s->out);
        goto fail;
    }
    if ((st = take_lock(d)) != BK_OK)
        goto fail;
    if ((st = clean_leftovers(d, s, &in, parent, adopted)) != BK_OK)
        goto fail;

    /* an existing output is replaced only with --overwrite (checked now, not
     * after the work) */
    if (lstat(d->final, &sb) == 0) {
        if (!S_ISDIR(sb.st_mode)) {
            st = bk_error(BK_ERR_USAGE, "--out %s: exists and is %s, not a folder", d->final,
                          bk_file_kind(sb.st_mode));
            goto fail;
        }
        if (!s->overwrite && !dir_is_empty(d->final)) {
            st = bk_error(BK_ERR_USAGE,
                          "--out %s: exists and is not empty (--overwrite replaces it when the "
                          "new output is complete)",
                          d->final);
            goto fail;
        }
        if ((st = old_replaceable(d)) != BK_OK)
            goto fail;
    }
    if (!(adopted && *adopted)) {
        bk_remove_tree(d->work);
        if (mkdir(d->work, 0755) != 0) {
            st = bk_error(BK_ERR_WRITE, "%s: cannot create the work folder: %s", d->work,
                          strerror(errno));
            goto fail;
        }
    }
    free(in.p);
    free(in.given);
    return BK_OK;
fail:
    free(in.p);
    free(in.given);
    release_lock(d);
    d->work[0] = '\0';
    return st;
}

bk_status bk_outdir_check(const bk_outdir_spec *s, uint64_t *free_bytes)
{
    bk_outdir dd, *d = &dd;
    memset(d, 0, sizeof *d);
    if (free_bytes)
        *free_bytes = 0;
    int exists;
    bk_status st = out_paths(d, s->out, &exists);
    if (st != BK_OK)
        return st;
    struct stat sb;
    inputs in = {0};
    if (inputs_alloc(&in) != BK_OK)
        return BK_ERR_NOMEM;
    st = collect_inputs(s->inputs, &in);
    if (st == BK_OK)
        st = check_safe(d, s, &in);
    free(in.p);
    free(in.given);
    if (st != BK_OK)
        return st;
    /* with leftovers of a killed run next to it, bk_outdir_open decides
     * (it restores or removes them first, with a message) */
    int leftovers = 0;
    {
        char par[BK_PATH_MAX];
        memcpy(par, d->canon, sizeof par);
        par[sizeof par - 1] = '\0';
        char *slash = strrchr(par, '/');
        char base[BK_PATH_MAX];
        snprintf(base, sizeof base, "%s", slash ? slash + 1 : par);
        if (slash == par)
            par[1] = '\0';
        else if (slash)
            *slash = '\0';
        DIR *pd = opendir(par);
        struct dirent *e;
        long pid;
        while (pd && (e = readdir(pd)) != NULL)
            if (leftover_kind(e->d_name, base, &pid))
                leftovers = 1;
        if (pd)
            closedir(pd);
    }
    if (exists && !s->overwrite && !leftovers && !dir_is_empty(d->final))
        return bk_error(BK_ERR_USAGE,
                        "--out %s: exists and is not empty (--overwrite replaces it when the "
                        "new output is complete)",
                        d->final);
    if (exists && (st = old_replaceable(d)) != BK_OK)
        return st;
    /* the nearest existing ancestor must let us create the work folder */
    char anc[BK_PATH_MAX];
    memcpy(anc, d->canon, sizeof anc);
    anc[sizeof anc - 1] = '\0';
    do {
        char *slash = strrchr(anc, '/');
        if (slash == anc)
            anc[1] = '\0';
        else if (slash)
            *slash = '\0';
        else
            break;
    } while (strcmp(anc, "/") != 0 && lstat(anc, &sb) != 0);
    if (stat(anc, &sb) != 0 || !S_ISDIR(sb.st_mode))
        return bk_error(BK_ERR_WRITE, "--out %s: %s is not a folder", d->final, anc);
    if (access(anc, W_OK | X_OK) != 0)
        return bk_error(BK_ERR_WRITE, "--out %s: cannot create the output in %s: %s", d->final,
                        anc, strerror(errno));
    struct statvfs vf;
    if (free_bytes && statvfs(anc, &vf) == 0)
        *free_bytes = (uint64_t)vf.f_bavail * (uint64_t)vf.f_frsize;
    return BK_OK;
}

bk_status bk_outdir_commit(bk_outdir *d)
{
    /* every file of the work folder on disk, then the folder itself */
    DIR *dir = opendir(d->work);
    if (!dir)
        return bk_error(BK_ERR_WRITE, "%s: cannot open the work folder: %s", d->work,
                        strerror(errno));
    struct dirent *e;
    while ((e = readdir(dir)) != NULL) {
        char sub[BK_PATH_MAX];
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..") ||
            bk_path_join(sub, sizeof sub, d->work, e->d_name) != BK_OK)
            continue;
        int fd = open(sub, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
        if (fd >= 0) {
            if (fsync(fd) != 0 && errno != EINVAL) {
                int er = errno;
                close(fd);
                closedir(dir);
                return bk_error(BK_ERR_WRITE, "%s: fsync failed: %s", sub, strerror(er));
            }
            close(fd);
        }
    }
    closedir(dir);
    fsync_path(d->work, 1);
    char parent[BK_PATH_MAX], old[BK_PATH_MAX + 32];
    parent_of(d->canon, parent, sizeof parent);
    snprintf(old, sizeof old, "%s.old-%ld", d->final, (long)getpid());

    kill_point("commit-begin");
    struct stat sb;
    if (lstat(d->final, &sb) == 0) {
        if (!S_ISDIR(sb.st_mode))
            return bk_error(BK_ERR_WRITE, "%s: appeared during the run and is %s, not a folder",
                            d->final, bk_file_kind(sb.st_mode));
        if (!d->overwrite && !dir_is_empty(d->final))
            return bk_error(BK_ERR_WRITE,
                            "%s: appeared during the run and is not empty (--overwrite replaces "
                            "it)",
                            d->final);
        const char *ne = getenv("BK_FAULT_NO_EXCHANGE");
        int swapped = 0;
        if (!(ne && !strcmp(ne, "1")) &&
            renameat2(AT_FDCWD, d->work, AT_FDCWD, d->final, RENAME_EXCHANGE) == 0)
            swapped = 1;
        else if (!(ne && !strcmp(ne, "1")) && errno != EINVAL && errno != ENOSYS &&
                 errno != EOPNOTSUPP && errno != ENOTSUP)
            return bk_error(BK_ERR_WRITE, "%s: cannot swap %s into place: %s", d->final, d->work,
                            strerror(errno));
        if (swapped) {
            /* one rename: the new output is in place, the old one under the
             * work folder's name */
            fsync_path(parent, 1);
            kill_point("commit-swapped");
            if (rename(d->work, old) != 0)
                snprintf(old, sizeof old, "%s", d->work);
            d->committed = 1;
            kill_point("commit-old-aside");
            bk_remove_tree(old);
            fsync_path(parent, 1);
            return BK_OK;
        }
        /* no atomic exchange here: old aside, new in, old deleted (a kill in
         * between leaves OUT.old-PID, which the next run puts back) */
        if (rename(d->final, old) != 0)
            return bk_error(BK_ERR_WRITE, "%s: cannot move the old output aside to %s: %s",
                            d->final, old, strerror(errno));
        fsync_path(parent, 1);
        kill_point("commit-aside");
        if (rename(d->work, d->final) != 0) {
            int er = errno;
            rename(old, d->final);
            return bk_error(BK_ERR_WRITE, "%s: cannot rename %s into place: %s", d->final,
                            d->work, strerror(er));
        }
        fsync_path(parent, 1);
        d->committed = 1;
        bk_remove_tree(old);
        return BK_OK;
    }
    if (rename(d->work, d->final) != 0)
        return bk_error(BK_ERR_WRITE, "%s: cannot rename %s into place: %s", d->final, d->work,
                        strerror(errno));
    fsync_path(parent, 1);
    d->committed = 1;
    return BK_OK;
}

void bk_outdir_close(bk_outdir *d)
{
    if (d->work[0] && !d->committed && !d->keep_work)
        bk_remove_tree(d->work);
    release_lock(d);
}
