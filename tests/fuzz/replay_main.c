/* Plain driver for the fuzz target: replays every file in the folders (or the
 * files) given on the command line through LLVMFuzzerTestOneInput. Used as an
 * ordinary test so the corpus runs in every build, including the sanitizer one. */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int replay_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "replay: cannot open %s\n", path);
        return 1;
    }
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    if (n < 0) {
        fclose(f);
        return 1;
    }
    /* an exact-size heap copy, so the sanitizers see any read past the end */
    uint8_t *buf = malloc(n ? (size_t)n : 1);
    if (!buf || (n && fread(buf, 1, (size_t)n, f) != (size_t)n)) {
        fprintf(stderr, "replay: cannot read %s\n", path);
        free(buf);
        fclose(f);
        return 1;
    }
    fclose(f);
    LLVMFuzzerTestOneInput(buf, (size_t)n);
    free(buf);
    return 0;
}

int main(int argc, char **argv)
{
    int files = 0, errors = 0;
    for (int a = 1; a < argc; a++) {
        struct stat st;
        if (stat(argv[a], &st) != 0) {
            fprintf(stderr, "replay: %s does not exist\n", argv[a]);
            errors++;
            continue;
        }
        if (!S_ISDIR(st.st_mode)) {
            errors += replay_file(argv[a]);
            files++;
            continue;
        }
        DIR *d = opendir(argv[a]);
        struct dirent *e;
        while (d && (e = readdir(d)) != NULL) {
            if (e->d_name[0] == '.')
                continue;
            char p[4096];
            snprintf(p, sizeof p, "%s/%s", argv[a], e->d_name);
            if (stat(p, &st) == 0 && S_ISREG(st.st_mode)) {
                errors += replay_file(p);
                files++;
            }
        }
        if (d)
            closedir(d);
    }
    printf("replayed %d files, %d errors\n", files, errors);
    return errors || files == 0 ? 1 : 0;
}
