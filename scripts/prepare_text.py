#!/usr/bin/env python3
"""Calibration and evaluation text for the SmolLM2 quality study, from Debian
packages, turned into bakron token files.

  calibration: the reStructuredText sources of the Python 3.11 documentation
               (Debian package python3.11-doc, usr/share/doc/python3.11/html/_sources/),
               with the markup reduced to the words a reader sees
  evaluation:  the Debian Reference (Debian package debian-reference-en,
               usr/share/debian-reference/*.en.html) as plain text
               (Python's html.parser; navigation, tables of contents and
               non-English paragraphs dropped)

Both packages are fetched with `apt-get download` (no install; run
`apt-get update` once on a fresh machine) and unpacked with `dpkg -x` under
CACHE (default data/cache). The texts are written one file per document under
OUT/text/{calib,eval}/, then tokenized by scripts/tokenize.py with the model's
tokenizer into

  OUT/calib.safetensors       128 x 512   (CPU study)
  OUT/calib-2048.safetensors  256 x 2048  (paper setting, GPU run)
  OUT/eval.safetensors         64 x 512
  OUT/eval-2048.safetensors    16 x 2048  (the same evaluation text in longer windows)

Windows are sampled without overlap, with fixed seeds, each starting with
<|endoftext|> (id 0, SmolLM2's document separator); documents are joined
with the same token. OUT/text/stats.json records package versions, document,
character and token counts.

    scripts/prepare_text.py --model data/smollm2/model --out data/smollm2

Exit codes: 0 ok, 1 usage, 2 bad input (unexpected package content),
3 runtime (apt-get/dpkg failed, cannot write).
"""
import argparse
import hashlib
import html.parser
import json
import os
import re
import shutil
import subprocess
import sys

# scripts/tokenize.py would shadow the standard library's `tokenize` module
# if this folder stayed first on sys.path.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZE = os.path.join(REPO_ROOT, "scripts", "tokenize.py")

# Package versions the documented counts were produced with (Debian 12).
CALIB_PKG = ("python3.11-doc", "3.11.2-6+deb12u9")
EVAL_PKG = ("debian-reference-en", "2.100")
CALIB_ROOT = "usr/share/doc/python3.11/html/_sources"
EVAL_ROOT = "usr/share/debian-reference"
# Legal boilerplate, not documentation prose.
CALIB_EXCLUDE = {"license.rst.txt", "copyright.rst.txt"}

SEP_ID = 0  # <|endoftext|>
TOKEN_FILES = [
    # name, source, seqlen, samples, seed
    ("calib.safetensors", "calib", 512, 128, 0),
    ("calib-2048.safetensors", "calib", 2048, 256, 0),
    ("eval.safetensors", "eval", 512, 64, 1),
    ("eval-2048.safetensors", "eval", 2048, 16, 1),
]


class Failure(Exception):
    def __init__(self, code, msg):
        super().__init__(msg)
        self.code = code


def log(msg):
    print(f"prepare_text: {msg}", file=sys.stderr, flush=True)


def run(cmd, cwd=None):
    r = subprocess.run(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        lines = [l for l in r.stdout.strip().splitlines() if l.startswith("E:")] or \
            r.stdout.strip().splitlines()[-1:] or ["(no output)"]
        raise Failure(3, f"{' '.join(cmd)} failed (exit {r.returncode}): {lines[0]}")
    return r.stdout


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_deb(cache, pkg, version):
    """apt-get download PKG[=VERSION] into CACHE/debs (once); returns the
    .deb path and its version."""
    debdir = os.path.join(cache, "debs")
    os.makedirs(debdir, exist_ok=True)
    have = sorted(n for n in os.listdir(debdir) if n.startswith(pkg + "_") and n.endswith(".deb"))
    if version:
        want = f"{pkg}_{version.replace(':', '%3a')}_all.deb"
        have = [n for n in have if n == want]
    if not have:
        spec = f"{pkg}={version}" if version else pkg
        log(f"apt-get download {spec}")
        tmp = os.path.join(debdir, f"download.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        os.chmod(tmp, 0o777)  # apt's _apt user writes here when it can
        try:
            run(["apt-get", "download", spec], cwd=tmp)
        except Failure as e:
            shutil.rmtree(tmp, ignore_errors=True)
            hint = (" (run 'apt-get update' first; if that version is gone from the archive, "
                    "use --any-version and note the new counts)")
            raise Failure(e.code, str(e) + hint)
        got = [n for n in os.listdir(tmp) if n.endswith(".deb")]
        if len(got) != 1:
            shutil.rmtree(tmp, ignore_errors=True)
            raise Failure(3, f"apt-get download {spec}: expected one .deb, got {got}")
        os.replace(os.path.join(tmp, got[0]), os.path.join(debdir, got[0]))
        shutil.rmtree(tmp, ignore_errors=True)
        have = [got[0]]
    deb = os.path.join(debdir, have[-1])
    ver = run(["dpkg-deb", "-f", deb, "Version"]).strip()
    name = run(["dpkg-deb", "-f", deb, "Package"]).strip()
    if name != pkg:
        raise Failure(2, f"{deb}: package is '{name}', expected '{pkg}'")
    return deb, ver


def extract_deb(cache, deb, pkg):
    """dpkg -x DEB CACHE/extract/PKG (redone when the .deb changes)."""
    dst = os.path.join(cache, "extract", pkg)
    stamp = os.path.join(dst, ".from-deb")
    digest = sha256_file(deb)
    try:
        with open(stamp) as f:
            if f.read().strip() == digest:
                return dst
    except OSError:
        pass
    tmp = f"{dst}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    run(["dpkg", "-x", deb, tmp])
    with open(os.path.join(tmp, ".from-deb"), "w") as f:
        f.write(digest + "\n")
    shutil.rmtree(dst, ignore_errors=True)
    os.replace(tmp, dst)
    return dst


# ------------------------------------------------------------ reStructuredText

# Directives whose whole block (line, options and indented body) is dropped:
# index entries, navigation, build instructions, file inclusions.
RST_DROP_BLOCK = {
    "index", "toctree", "highlight", "sectionauthor", "moduleauthor", "module",
    "currentmodule", "include", "literalinclude", "tabularcolumns", "testsetup",
    "testcleanup", "audit-event", "audit-event-table", "raw", "image", "figure",
    "contents", "miscnews", "limited-api-list", "program", "only", "productionlist",
}
# Admonitions: replaced by the words the rendered page shows.
RST_ADMONITION = {
    "note": "Note:", "warning": "Warning:", "seealso": "See also:", "important": "Important:",
    "caution": "Caution:", "impl-detail": "CPython implementation detail:",
    "availability": "Availability:",
}
RST_VERSIONED = {
    "versionadded": "New in version {}.", "versionchanged": "Changed in version {}:",
    "deprecated": "Deprecated since version {}:",
    "deprecated-removed": "Deprecated since version {}, will be removed in version {}:",
}
DIRECTIVE = re.compile(r"^(\s*)\.\.\s+([A-Za-z][\w:-]*)::\s?(.*)$")
COMMENT_OR_TARGET = re.compile(r"^(\s*)\.\.(\s.*)?$")
OPTION = re.compile(r"^\s+:[\w-]+:(\s.*)?$")
ADORNMENT = re.compile(r"^\s*([=\-~^*#\"+`'.:_])\1{2,}\s*$")
ROLE = re.compile(r":[\w:+-]+:`([^`]*)`")
REF = re.compile(r"`([^`<]+?)\s*<[^`>]*>`_{1,2}")
LITERAL = re.compile(r"``(.+?)``")
# inline markup rules of reStructuredText: the start-string follows
# whitespace or opening punctuation, the end-string precedes whitespace or
# closing punctuation (so f(*args, **kwargs) is left alone)
_PRE = r"(?<![^\s(\[{<'\"/:-])"
_POST = r"(?![^\s.,;:!?)'\"/\\\]}>-])"
STRONG = re.compile(_PRE + r"\*\*(?![\s*])([^*]+?)(?<![\s*])\*\*" + _POST)
EMPH = re.compile(_PRE + r"\*(?![\s*])([^*]+?)(?<![\s*])\*" + _POST)
INTERPRETED = re.compile(r"`([^`]+)`_{0,2}")


def role_text(m):
    t = m.group(1).strip()
    if t.startswith("!"):
        t = t[1:]
    lt = re.match(r"^(.*?)\s*<([^>]*)>$", t)
    if lt and lt.group(1):
        return lt.group(1)
    if t.startswith("~"):
        t = t[1:].split(".")[-1]
    return t


def inline(line):
    line = ROLE.sub(role_text, line)
    line = REF.sub(r"\1", line)
    line = LITERAL.sub(r"\1", line)
    line = STRONG.sub(r"\1", line)
    line = EMPH.sub(r"\1", line)
    line = INTERPRETED.sub(r"\1", line)
    line = line.replace("\\ ", "")
    if line.rstrip().endswith("::"):
        s = line.rstrip()[:-2].rstrip()
        line = s + ":" if s.strip() else ""
    return line


def indent_of(line):
    return len(line) - len(line.lstrip(" "))


def rst_to_text(src):
    """Reduce reStructuredText to the words a reader of the rendered page
    sees (rules documented in docs/smollm2.md). Code blocks are kept."""
    lines = src.expandtabs(8).splitlines()
    out = []
    i, n = 0, len(lines)
    while i < n:
        line = lines[i]
        m = DIRECTIVE.match(line)
        if m:
            ind, name, arg = len(m.group(1)), m.group(2), m.group(3).strip()
            i += 1
            if name in RST_DROP_BLOCK or name.startswith("|"):
                while i < n and (not lines[i].strip() or indent_of(lines[i]) > ind):
                    i += 1
                continue
            while i < n and OPTION.match(lines[i]) and indent_of(lines[i]) > ind:
                i += 1
            pad = " " * ind
            if name in RST_ADMONITION:
                out.append(pad + RST_ADMONITION[name] + (" " + inline(arg) if arg else ""))
            elif name in RST_VERSIONED:
                parts = arg.split(None, 1) if name != "deprecated-removed" else arg.split(None, 2)
                nfmt = RST_VERSIONED[name].count("{}")
                vals = (parts + [""] * nfmt)[:nfmt]
                out.append(pad + RST_VERSIONED[name].format(*vals))
                rest = parts[nfmt:] if len(parts) > nfmt else []
                if rest:
                    out.append(pad + "   " + inline(rest[0]))
            elif arg and name not in ("code-block", "sourcecode", "doctest", "testcode",
                                      "testoutput", "parsed-literal", "list-table", "table",
                                      "rubric", "topic", "sidebar", "epigraph", "glossary"):
                out.append(pad + inline(arg))  # a signature: function(args), class, ...
            elif arg and name in ("rubric", "topic", "sidebar", "table", "list-table"):
                out.append(pad + inline(arg))  # a title
            continue
        m = COMMENT_OR_TARGET.match(line)
        if m and not line.strip().startswith(".. |"):
            ind = len(m.group(1))
            i += 1
            while i < n and lines[i].strip() and indent_of(lines[i]) > ind:
                i += 1
            continue
        if line.strip().startswith(".. |"):  # substitution definition
            i += 1
            continue
        if ADORNMENT.match(line):
            i += 1
            continue
        out.append(inline(line).rstrip())
        i += 1
    text = "\n".join(out)
    text = re.sub(r"\n{3,}", "\n\n", text).strip("\n")
    return text + "\n" if text else ""


# ----------------------------------------------------------------------- HTML

BLOCK_TAGS = {"p", "div", "h1", "h2", "h3", "h4", "h5", "h6", "li", "dt", "dd", "tr", "pre",
              "table", "ul", "ol", "dl", "blockquote", "br", "hr", "title", "caption"}
SKIP_TAGS = {"head", "script", "style"}
SKIP_CLASSES = {"navheader", "navfooter", "toc", "list-of-tables", "list-of-figures"}
VOID_TAGS = {"br", "hr", "img", "meta", "link", "input", "area", "base", "col", "wbr"}


class TextExtractor(html.parser.HTMLParser):
    """Plain text of an XHTML page: block elements start new lines, table
    cells are separated by ' | ', <pre> keeps its whitespace, navigation and
    tables of contents are dropped."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.stack = []  # (tag, skip, pre)
        self.blocks = []
        self.cur = []
        self.row_cells = 0

    def skipping(self):
        return any(s for _, s, _ in self.stack)

    def in_pre(self):
        return any(p for _, _, p in self.stack)

    def flush(self):
        t = "".join(self.cur)
        self.cur = []
        if self.in_pre():
            t = t.strip("\n")
        else:
            t = re.sub(r"[ \t\r\n\u00a0]+", " ", t).strip()
            # a row whose first cells hold only an icon starts with separators
            t = re.sub(r"^(\|\s*)+|(\s*\|)+$", "", t).strip()
        if t:
            self.blocks.append(t)

    def handle_starttag(self, tag, attrs):
        classes = set((dict(attrs).get("class") or "").split())
        if tag in BLOCK_TAGS:
            self.flush()
        if tag in ("td", "th"):
            if self.row_cells and not self.skipping():
                self.cur.append(" | ")
            self.row_cells += 1
        if tag == "tr":
            self.row_cells = 0
        if tag in VOID_TAGS:
            return
        skip = tag in SKIP_TAGS or bool(classes & SKIP_CLASSES)
        self.stack.append((tag, skip, tag == "pre"))

    def handle_startendtag(self, tag, attrs):
        if tag in BLOCK_TAGS:
            self.flush()

    def handle_endtag(self, tag):
        if tag in VOID_TAGS:
            return
        if tag in BLOCK_TAGS:
            self.flush()
        # pop to the matching tag (tolerates unclosed children)
        for k in range(len(self.stack) - 1, -1, -1):
            if self.stack[k][0] == tag:
                del self.stack[k:]
                break

    def handle_data(self, data):
        if not self.skipping():
            self.cur.append(data)

    def close(self):
        super().close()
        self.flush()


def is_english(block):
    """A block is kept unless more than 10% of its letters are outside the
    Latin script (the Debian Reference quotes a few non-English examples)."""
    letters = [c for c in block if c.isalpha()]
    if not letters:
        return True
    latin = sum(1 for c in letters if ord(c) < 0x250)
    return latin >= 0.9 * len(letters)


def html_to_text(src, label):
    p = TextExtractor()
    try:
        p.feed(src)
        p.close()
    except Exception as e:  # html.parser raises on some malformed input
        raise Failure(2, f"{label}: cannot parse HTML: {e}")
    kept = [b for b in p.blocks if is_english(b)]
    text = "\n\n".join(kept)
    return (text + "\n" if text else ""), len(p.blocks) - len(kept)


# ----------------------------------------------------------------- documents

def write_docs(docs, dst):
    """docs: [(name, text)] -> dst/name (built in dst.tmp-PID, renamed)."""
    tmp = f"{dst}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    for name, text in docs:
        with open(os.path.join(tmp, name), "w", encoding="utf-8") as f:
            f.write(text)
    shutil.rmtree(dst, ignore_errors=True)
    os.replace(tmp, dst)


def calib_docs(root):
    base = os.path.join(root, CALIB_ROOT)
    if not os.path.isdir(base):
        raise Failure(2, f"{base}: missing (python3.11-doc layout changed?)")
    docs, skipped = [], []
    for dirpath, dirnames, names in os.walk(base):
        dirnames.sort()
        for nm in sorted(names):
            rel = os.path.relpath(os.path.join(dirpath, nm), base)
            if not nm.endswith(".rst.txt"):
                continue
            if rel in CALIB_EXCLUDE:
                skipped.append(rel)
                continue
            with open(os.path.join(dirpath, nm), encoding="utf-8") as f:
                text = rst_to_text(f.read())
            if text.strip():
                docs.append((rel[:-len(".rst.txt")].replace(os.sep, "__") + ".txt", text))
    if not docs:
        raise Failure(2, f"{base}: no .rst.txt sources found")
    return docs, skipped


def eval_docs(root):
    base = os.path.join(root, EVAL_ROOT)
    if not os.path.isdir(base):
        raise Failure(2, f"{base}: missing (debian-reference-en layout changed?)")
    docs, dropped = [], 0
    for nm in sorted(os.listdir(base)):
        if not nm.endswith(".en.html"):
            continue
        path = os.path.join(base, nm)
        with open(path, encoding="utf-8") as f:
            text, d = html_to_text(f.read(), path)
        dropped += d
        if text.strip():
            docs.append((nm[:-len(".en.html")] + ".txt", text))
    if not docs:
        raise Failure(2, f"{base}: no *.en.html pages found")
    return docs, dropped


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(REPO_ROOT, "data", "smollm2", "model"),
                    help="model folder with tokenizer.json (scripts/fetch_smollm2.py)")
    ap.add_argument("--out", default=os.path.join(REPO_ROOT, "data", "smollm2"))
    ap.add_argument("--cache", default=os.path.join(REPO_ROOT, "data", "cache"))
    ap.add_argument("--any-version", action="store_true",
                    help="take the archive's current package versions instead of the pinned ones")
    ap.add_argument("--text-only", action="store_true", help="stop after writing the text")
    a = ap.parse_args()

    if not a.text_only and not os.path.isfile(os.path.join(a.model, "tokenizer.json")):
        raise Failure(1, f"{a.model}/tokenizer.json: not found (run scripts/fetch_smollm2.py first)")
    os.makedirs(a.cache, exist_ok=True)
    stats = {"packages": {}}
    roots = {}
    for role, (pkg, ver) in (("calib", CALIB_PKG), ("eval", EVAL_PKG)):
        deb, got = fetch_deb(a.cache, pkg, None if a.any_version else ver)
        roots[role] = extract_deb(a.cache, deb, pkg)
        stats["packages"][role] = {"package": pkg, "version": got, "sha256": sha256_file(deb)}
        log(f"{role}: {pkg} {got}")

    cdocs, skipped = calib_docs(roots["calib"])
    edocs, dropped = eval_docs(roots["eval"])
    textdir = os.path.join(a.out, "text")
    os.makedirs(textdir, exist_ok=True)
    write_docs(cdocs, os.path.join(textdir, "calib"))
    write_docs(edocs, os.path.join(textdir, "eval"))
    stats["calib_text"] = {"documents": len(cdocs), "characters": sum(len(t) for _, t in cdocs),
                           "excluded": skipped}
    stats["eval_text"] = {"documents": len(edocs), "characters": sum(len(t) for _, t in edocs),
                          "non_english_blocks_dropped": dropped}
    log(f"calib text: {len(cdocs)} documents, {stats['calib_text']['characters']} characters")
    log(f"eval text: {len(edocs)} documents, {stats['eval_text']['characters']} characters "
        f"({dropped} non-English blocks dropped)")

    if not a.text_only:
        stats["token_files"] = {}
        for name, src, seqlen, samples, seed in TOKEN_FILES:
            out = os.path.join(a.out, name)
            cmd = [sys.executable, TOKENIZE, "--model", a.model, "--seqlen", str(seqlen),
                   "--samples", str(samples), "--shuffle", "--seed", str(seed),
                   "--bos", str(SEP_ID), "--doc-sep", str(SEP_ID), "--out", out,
                   os.path.join(textdir, src)]
            log(" ".join(os.path.relpath(c, REPO_ROOT) if os.path.isabs(c) else c for c in cmd[1:]))
            msg = run(cmd).strip()
            log(msg)
            from safetensors import safe_open
            with safe_open(out, "np") as f:
                meta = f.metadata()
                ids = f.get_tensor("input_ids")
            stats["token_files"][name] = {
                "text": src, "seqlen": seqlen, "windows": samples, "seed": seed,
                "total_tokens": int(meta["total_tokens"]),
                "windows_available": int(meta["windows_available"]),
                "input_ids_sha256": hashlib.sha256(ids.astype("<i4").tobytes()).hexdigest()}
    sp = os.path.join(textdir, "stats.json")
    with open(sp + ".tmp", "w") as f:
        json.dump(stats, f, indent=2)
        f.write("\n")
    os.replace(sp + ".tmp", sp)
    print(json.dumps(stats, indent=2))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Failure as e:
        print(f"prepare_text: error: {e}", file=sys.stderr)
        sys.exit(e.code)
    except OSError as e:
        print(f"prepare_text: error: {e.filename or ''}: {e.strerror or e}", file=sys.stderr)
        sys.exit(3)
