//! The documents a new user reads first: figures that can be traced, and no words about how the
//! repository was made.
//! - Every timing in the README's command tables names the date it was measured and
//!   docs/PERF.md, whose "Current figures" table holds a row for the same command and date (the
//!   README once quoted 33 s for `csa2 trace` while PERF.md said 0.53 s).
//! - README.md, CHANGELOG.md and every docs/*.md carry no remarks about machines being lent,
//!   numbered working periods, issue numbers, who reruns what, work branches, or notes and tools
//!   that are not in the repository.

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

/// Whether `line` names an issue of this project, ignoring case: the word "issue" followed by
/// optional spaces or hyphens and a digit, or "issues" followed by a list of numbers (a comma or a
/// slash after the first). The verb stays legal: "it issues 24 FMAs", and so does another
/// project's "issue #N".
fn names_an_issue(line: &str) -> bool {
    let lower = line.to_lowercase();
    let b = lower.as_bytes();
    lower.match_indices("issue").any(|(i, w)| {
        if i > 0 && b[i - 1].is_ascii_alphanumeric() {
            return false;
        }
        let mut j = i + w.len();
        let plural = b.get(j) == Some(&b's');
        if plural {
            j += 1;
        }
        while b.get(j) == Some(&b' ') || (!plural && b.get(j) == Some(&b'-')) {
            j += 1;
        }
        let digits = b[j..].iter().take_while(|c| c.is_ascii_digit()).count();
        digits > 0 && (!plural || matches!(b.get(j + digits), Some(b',' | b'/')))
    })
}

/// Whether `line` holds `phrase`, ignoring case, as whole words: where the phrase begins or ends
/// with a letter or digit, the text must not go on with the word on that side (so "lead" is not
/// found in "leading"); a plural ending ("-s", "-es") still counts.
fn has_phrase(line: &str, phrase: &str) -> bool {
    let (lower, phrase) = (line.to_lowercase(), phrase.to_lowercase());
    let (b, p) = (lower.as_bytes(), phrase.as_bytes());
    let word = |c: Option<&u8>| c.is_some_and(u8::is_ascii_alphanumeric);
    lower.match_indices(&phrase).any(|(i, _)| {
        let after = &b[i + p.len()..];
        let after = after
            .strip_prefix(b"es")
            .or_else(|| after.strip_prefix(b"s"))
            .unwrap_or(after);
        (!word(p.first()) || i == 0 || !word(b.get(i - 1)))
            && (!word(p.last()) || !word(after.first()))
    })
}

#[test]
fn the_issue_and_phrase_matchers_tell_the_making_from_the_product() {
    // Built from parts, like the phrases below, so this file names no issue and no lead itself.
    let issue = ["iss", "ue"].concat();
    let up = issue.to_uppercase();
    for hit in [
        format!("({issue} 28, 2026-12-05)"),
        format!("{up} 13, finding 7: handles"),
        format!("the {issue}-13 tests"),
        format!("new exports ({issue}s 15, 16)"),
        format!("({issue}s 14/15)"),
        format!("{issue}  17"),
    ] {
        assert!(names_an_issue(&hit), "{hit}");
    }
    for miss in [
        "per 16-dim step it issues 24 FMAs",
        "the int16 scores issue `vpdpwssd` whole",
        "cross-process reuse in vLLM (issue #51875)",
        "an issued copy poisons its shared destination",
        "tissue 3",
    ] {
        assert!(!names_an_issue(miss), "{miss}");
    }
    let lead = ["the ", "lead"].concat();
    assert!(has_phrase(&["The Le", "ad's quiet rerun"].concat(), &lead));
    assert!(!has_phrase("the leading dimension", &lead));
    let tree = ["work", "tree"].concat();
    assert!(has_phrase(&["two Work", "trees"].concat(), &tree));
    assert!(!has_phrase("a networktree", &tree));
    assert!(!has_phrase(&["work", "treetop"].concat(), &tree));
}

#[test]
fn the_docs_say_nothing_about_how_the_repository_was_made() {
    // Phrases that would describe the repository's making rather than the product, matched
    // ignoring case as whole words (`has_phrase`); project issue numbers are `names_an_issue`.
    // The ones that are also ordinary words elsewhere are joined from parts, so this file does not
    // itself read as such text.
    let joined = [
        ["the b", "rief"].concat(),
        ["research ", "notes"].concat(),
        ["helpers' ", "branch"].concat(),
        ["helper ", "branch"].concat(),
        ["the ", "lead"].concat(),
        ["work", "tree"].concat(),
        ["farm-", "studio"].concat(),
        ["lent-", "GPU"].concat(),
        ["final ", "tree"].concat(),
        ["available to this ", "work"].concat(),
    ];
    let mut banned: Vec<&str> = joined.iter().map(String::as_str).collect();
    banned.extend([
        " lent",
        "loans",
        "first session",
        "second session",
        "third session",
        "fourth session",
        "fifth session",
        "sixth session",
        "drawn a device",
    ]);
    // Every docs/*.md as the directory holds it now, so a new page is read too.
    let dir = Path::new(crate::REPO_ROOT).join("docs");
    let mut pages: Vec<String> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.ends_with(".md"))
        .map(|name| format!("docs/{name}"))
        .collect();
    pages.sort();
    assert!(
        pages.iter().any(|p| p == "docs/PERF.md"),
        "docs/*.md listed as {pages:?}"
    );
    let mut docs = vec!["README.md".to_string(), "CHANGELOG.md".to_string()];
    docs.extend(pages);
    for doc in &docs {
        let text = read(doc);
        for (n, line) in text.lines().enumerate() {
            assert!(
                !names_an_issue(line),
                "{doc}:{}: an issue number speaks of how the repository was made; name the thing \
                 itself: {line}",
                n + 1
            );
            for b in &banned {
                assert!(
                    !has_phrase(line, b),
                    "{doc}:{}: `{b}` speaks of how the repository was made: {line}",
                    n + 1
                );
            }
        }
    }
}
