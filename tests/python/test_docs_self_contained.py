"""The repository stands on its own: no file points outside it, and every citation of the
specification names a section that docs/SPEC.md has.

Finding ("The SPEC is not in the repository"): README, docs and `csa2 run --help` cited
"SPEC §1–§5" and research notes that only existed outside the repository, and docs/TRACE.md ran a
trace from a directory beside the checkout that a clone does not have.
"""

import os
import pathlib
import re

from conftest import ROOT

# Text files a user of the repository reads or runs; build outputs and venvs are not ours.
SKIP_DIRS = {".git", "target", "__pycache__", "build", "corpus", "artifacts", "coverage"}
TEXT_SUFFIXES = {".rs", ".py", ".md", ".sh", ".toml", ".h", ".cu", ".cuh", ".c", ".txt", ".cfg"}

# Paths of the workspace the project was written in, which a clone does not have.
OUTSIDE = re.compile(
    r"\.\./shared/|\bshared/(?:ref|research|seeds)/|\bresearch/[a-z_]+\.md"
    r"|\bseeds/[0-9]|\bref/traces/|\breference_math\b|\bvllm_v41\.md|\bvllm_route\.md"
    r"|\btiered_kv\.md|\btoolchain\.md"
)
# Cheap substring test first: the regex alone is slow over every line of the repository.
OUTSIDE_HINTS = ("shared", "research/", "seeds/", "ref/traces", "reference_math", "vllm_v41.md",
                 "vllm_route.md", "tiered_kv.md", "toolchain.md")
# "SPEC §N" not preceded by the path.
BARE_SPEC = re.compile(r"(?<!docs/)\bSPEC\b(?!\.md)")
CITATION = re.compile(r"docs/SPEC\.md §(\d+(?:\.\d+)?)")
HEADING = re.compile(r"^#{2,3} (\d+(?:\.\d+)?)[. ]", re.M)


def repo_text_files():
    me = pathlib.Path(__file__).name
    for top, dirs, files in os.walk(ROOT):
        # Prune build outputs and venvs before descending (target/ alone holds GBs).
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith(".venv"))
        for name in sorted(files):
            path = pathlib.Path(top) / name
            if path.suffix in TEXT_SUFFIXES and name != me:
                yield path.relative_to(ROOT), path.read_text(encoding="utf-8", errors="replace")


def test_nothing_points_outside_the_repository():
    bad = [
        f"{rel}:{n}: {line.strip()}"
        for rel, text in repo_text_files()
        if any(h in text for h in OUTSIDE_HINTS) and OUTSIDE.search(text)
        for n, line in enumerate(text.splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert not bad, "references to files outside the repository:\n" + "\n".join(bad)


def test_spec_citations_name_the_file_and_an_existing_section():
    spec = (ROOT / "docs" / "SPEC.md").read_text(encoding="utf-8")
    sections = set(HEADING.findall(spec))
    # Top-level sections §0–§6 are the numbering every older citation used.
    assert {str(n) for n in range(7)} <= sections, sorted(sections)
    bare, missing = [], []
    for rel, text in repo_text_files():
        if rel.as_posix() == "docs/SPEC.md" or "SPEC" not in text:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if BARE_SPEC.search(line):
                bare.append(f"{rel}:{n}: {line.strip()}")
            missing += [f"{rel}:{n}: §{s}" for s in CITATION.findall(line) if s not in sections]
    assert not bare, "SPEC cited without its path (docs/SPEC.md):\n" + "\n".join(bare)
    assert not missing, "citations of sections docs/SPEC.md does not have:\n" + "\n".join(missing)


def test_documented_assets_ship_with_the_repository():
    names = set()
    for rel, text in repo_text_files():
        names.update(re.findall(r"\bassets/[A-Za-z0-9_.\-]+", text))
    assert "assets/mooncake_conversation_trace.jsonl.gz" in names
    absent = sorted(n.rstrip(".") for n in names if not (ROOT / n.rstrip(".")).exists())
    assert not absent, f"documented but not shipped: {absent}"
    notice = (ROOT / "assets" / "NOTICE").read_text(encoding="utf-8")
    assert "Apache License, Version 2.0" in notice and "kvcache-ai/Mooncake" in notice
