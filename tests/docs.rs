//! The documents a new user reads first: figures that can be traced, and no words about how the
//! repository was made.
//! - Every timing in the README's command tables names the date it was measured and
//!   docs/PERF.md, whose "Current figures" table holds a row for the same command and date (the
//!   README once quoted 33 s for `csa2 trace` while PERF.md said 0.53 s).
//! - README.md and the docs carry no remarks about machines being lent, numbered working periods,
//!   issue numbers or notes that are not in the repository.

use std::path::Path;

fn read(rel: &str) -> String {
    std::fs::read_to_string(Path::new(crate::REPO_ROOT).join(rel)).unwrap()
}

/// The lines of `doc` from the heading `title` (exact `## ` line) to the next `## ` heading.
fn section<'a>(doc: &'a str, title: &str) -> Vec<&'a str> {
    doc.lines()
        .skip_while(|l| l.trim() != title)
        .skip(1)
        .take_while(|l| !l.starts_with("## "))
        .collect()
}

/// The dates (YYYY-MM-DD) in `s`.
fn dates(s: &str) -> Vec<&str> {
    let b = s.as_bytes();
    (0..b.len().saturating_sub(9))
        .filter(|&i| {
            let d = &b[i..i + 10];
            d[..4].iter().all(u8::is_ascii_digit)
                && d[4] == b'-'
                && d[5..7].iter().all(u8::is_ascii_digit)
                && d[7] == b'-'
                && d[8..].iter().all(u8::is_ascii_digit)
                && (i == 0 || !b[i - 1].is_ascii_digit())
        })
        .map(|i| &s[i..i + 10])
        .collect()
}

/// Whether a table cell states a duration (`0.3 s`, `1 min 12 s`, `35 ms`).
fn has_duration(cell: &str) -> bool {
    let w: Vec<&str> = cell.split_whitespace().collect();
    w.windows(2).any(|p| {
        let num = p[0].trim_start_matches(['*', '(', '≈', '~']);
        !num.is_empty()
            && num
                .chars()
                .all(|c| c.is_ascii_digit() || c == '.' || c == ',')
            && num.chars().next().unwrap().is_ascii_digit()
            && ["s", "min", "ms", "s,", "s;", "s)", "min,", "s**", "min**"]
                .contains(&p[1].trim_end_matches(['.']))
    })
}

#[test]
fn every_readme_timing_names_a_perf_entry_of_the_same_date() {
    let readme = read("README.md");
    let perf = read("docs/PERF.md");
    let current = section(&perf, "## Current figures");
    assert!(
        !current.is_empty(),
        "docs/PERF.md has a `## Current figures` section"
    );
    let mut rows = 0;
    for title in ["## Start", "## Other commands"] {
        for line in section(&readme, title) {
            if !line.starts_with('|') {
                continue;
            }
            let cells: Vec<&str> = line.split('|').map(str::trim).collect();
            if !cells.iter().skip(2).any(|c| has_duration(c)) {
                continue;
            }
            rows += 1;
            let cmd = cells[1]
                .split('`')
                .nth(1)
                .unwrap_or_else(|| panic!("README timing row without a `command`: {line}"));
            let ds = dates(line);
            assert!(!ds.is_empty(), "README timing row without its date: {line}");
            assert!(
                line.contains("docs/PERF.md"),
                "README timing row does not name docs/PERF.md: {line}"
            );
            for d in ds {
                assert!(
                    current
                        .iter()
                        .any(|l| l.contains(&format!("`{cmd}`")) && l.contains(d)),
                    "README times `{cmd}` on {d}; docs/PERF.md § Current figures has no row for \
                     that command and date"
                );
            }
        }
    }
    assert!(rows >= 5, "found {rows} README timing rows");
}

#[test]
fn the_docs_say_nothing_about_how_the_repository_was_made() {
    // Phrases that would describe the repository's making rather than the product; the ones
    // that are also ordinary words elsewhere are joined from parts, so this file does not
    // itself read as such text.
    let joined = [
        ["the b", "rief"].concat(),
        ["research ", "notes"].concat(),
        ["helpers' ", "branch"].concat(),
        ["helper ", "branch"].concat(),
    ];
    let banned = [
        " lent",
        "loans",
        joined[0].as_str(),
        joined[1].as_str(),
        joined[2].as_str(),
        joined[3].as_str(),
        "first session",
        "second session",
        "third session",
        "fourth session",
        "fifth session",
        "sixth session",
        "Issue 1",
        "(issue 1",
        "drawn a device",
    ];
    for doc in [
        "README.md",
        "docs/PERF.md",
        "docs/ARCHITECTURE.md",
        "docs/TRACE.md",
        "docs/VLLM.md",
    ] {
        let text = read(doc);
        for (n, line) in text.lines().enumerate() {
            for b in banned {
                assert!(
                    !line.contains(b),
                    "{doc}:{}: `{b}` speaks of how the repository was made: {line}",
                    n + 1
                );
            }
        }
    }
}
