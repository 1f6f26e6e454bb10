/* The stat loop of a data set's rerun check, in C: Python's os.stat costs ~1.5 us per call
 * above the syscall (its result object), which on 1M files is most of the check. Built on first
 * use by pipelines/native_stat.py with the system C compiler and called through ctypes (which
 * releases the GIL, so threads run slices in parallel). Same answers as os.stat. */
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#ifdef __APPLE__
#define MTIME_NS(st) ((int64_t)(st).st_mtimespec.tv_sec * 1000000000LL + (st).st_mtimespec.tv_nsec)
#else
#define MTIME_NS(st) ((int64_t)(st).st_mtim.tv_sec * 1000000000LL + (st).st_mtim.tv_nsec)
#endif

/* The last '/' in the `len` bytes at `p`, or NULL (memrchr is not everywhere). */
static const char *last_slash(const char *p, size_t len) {
    while (len--)
        if (p[len] == '/') return p + len;
    return NULL;
}

/* Stats `count` paths in `names` (under the folder `root`, each ending in a NUL, best grouped
 * by folder: each folder is opened once and its files stat-ed relative to it, symlinks
 * followed as os.stat does). For path i: regular[i] = 1 when it is a regular file, with its
 * size and mtime_ns in sizes[i] / mtimes[i]; else regular[i] = 0 (gone, a folder, unreadable).
 * Returns the number of regular files, or -1 when `root` cannot be opened or memory runs out
 * (the caller then checks another way). */
long splitstage_stat(const char *root, const char *names, long count, int64_t *sizes,
                     int64_t *mtimes, uint8_t *regular) {
    int root_fd = open(root, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (root_fd < 0) return -1;
    const char *folder = NULL; /* the current folder: a prefix of some name, not terminated */
    size_t folder_len = 0;
    char *folder_path = NULL;
    size_t folder_cap = 0;
    int fd = -1;
    long found = 0;
    const char *p = names;
    for (long i = 0; i < count; i++) {
        size_t len = strlen(p);
        const char *slash = last_slash(p, len);
        size_t where_len = slash ? (size_t)(slash - p) : 0;
        if (folder == NULL || where_len != folder_len || memcmp(folder, p, where_len) != 0) {
            if (fd >= 0 && fd != root_fd) close(fd);
            folder = p;
            folder_len = where_len;
            fd = root_fd;
            if (where_len) {
                if (where_len + 1 > folder_cap) {
                    free(folder_path);
                    folder_cap = 2 * (where_len + 1);
                    folder_path = malloc(folder_cap);
                    if (folder_path == NULL) {
                        close(root_fd);
                        return -1;
                    }
                }
                memcpy(folder_path, p, where_len);
                folder_path[where_len] = '\0';
                fd = openat(root_fd, folder_path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
            }
        }
        struct stat st;
        int failed = fd >= 0 ? fstatat(fd, slash ? slash + 1 : p, &st, 0)
                             : fstatat(root_fd, p, &st, 0); /* folder not openable: whole path */
        int ok = failed == 0 && S_ISREG(st.st_mode);
        regular[i] = (uint8_t)ok;
        sizes[i] = ok ? (int64_t)st.st_size : -1;
        mtimes[i] = ok ? MTIME_NS(st) : -1;
        found += ok;
        p += len + 1;
    }
    if (fd >= 0 && fd != root_fd) close(fd);
    close(root_fd);
    free(folder_path);
    return found;
}
