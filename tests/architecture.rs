//! The shape of the code, checked: the top-level modules import one another without a cycle
//! (a module reads only modules below it, so each can be read, and changed, knowing only
//! those), and so do the files inside each module. What imports what is read from the
//! sources: every `crate::<module>` path and `super::<file>` path outside comments and unit
//! tests.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A source file's code, without comments and without its `#[cfg(test)] mod tests` (tests may
/// reach anywhere).
fn code(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap();
    let text = text.split("#[cfg(test)]\nmod tests").next().unwrap();
    text.lines().map(|line| line.split("//").next().unwrap()).collect::<Vec<_>>().join("\n")
}

/// Every `.rs` file under `dir`.
fn files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            out.extend(files(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
    out.sort();
    out
}

/// The names `prefix` is followed by in `code` (`crate::` → `hub`, `store`, ...), including
/// those in a `use crate::{a, b::c}` group.
fn named_after(code: &str, prefix: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let ident = |s: &str| s.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect::<String>();
    for (at, _) in code.match_indices(prefix) {
        let rest = &code[at + prefix.len()..];
        if let Some(group) = rest.strip_prefix('{') {
            // The group's top-level names: each item after `{` or a `,` at depth 0.
            let mut depth = 0;
            let mut start = true;
            for (i, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => start = true,
                    c if c.is_whitespace() => {}
                    _ if start => {
                        names.insert(ident(&group[i..]));
                        start = false;
                    }
                    _ => {}
                }
            }
        } else {
            names.insert(ident(rest));
        }
    }
    names
}

/// A cycle in `graph`, if there is one, as the path around it.
fn cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|n| n == node) {
            let mut around = path[at..].to_vec();
            around.push(node.to_owned());
            return Some(around);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_owned());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(found) = visit(next, graph, path, done) {
                return Some(found);
            }
        }
        path.pop();
        done.insert(node.to_owned());
        None
    }
    let mut done = BTreeSet::new();
    graph.keys().find_map(|node| visit(node, graph, &mut Vec::new(), &mut done))
}

/// The gateway's sources and its fan-out core's (a crate of its own, below the gateway).
fn roots() -> [PathBuf; 2] {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    [manifest.join("src"), manifest.join("crates/fanout/src")]
}

/// The top-level module a file under `root` belongs to (`src/turn/run.rs` → `turn`,
/// `src/net.rs` → `net`).
fn top_module(root: &Path, file: &Path) -> String {
    let relative = file.strip_prefix(root).unwrap();
    let first = relative.components().next().unwrap().as_os_str().to_string_lossy().into_owned();
    first.trim_end_matches(".rs").to_owned()
}

/// What each top-level module of a crate imports of the others.
fn module_graph(root: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let all = files(root);
    let modules: BTreeSet<String> = all.iter().map(|f| top_module(root, f)).collect();
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in &all {
        let from = top_module(root, file);
        let to: Vec<String> =
            named_after(&code(file), "crate::").into_iter().filter(|m| modules.contains(m) && *m != from).collect();
        graph.entry(from).or_default().extend(to);
    }
    graph
}

#[test]
fn the_top_level_modules_import_one_another_without_a_cycle() {
    let [gateway, fanout] = roots();
    let gateway = module_graph(&gateway);
    let fanout = module_graph(&fanout);
    // The reading of imports finds them.
    assert!(gateway["turn"].contains("store"), "{gateway:?}");
    assert!(fanout["hub"].contains("encoding"), "{fanout:?}");
    for graph in [gateway, fanout] {
        if let Some(around) = cycle(&graph) {
            panic!("the top-level modules import in a cycle: {}", around.join(" -> "));
        }
    }
}

/// The fan-out core knows the wire and nothing else of the gateway: its manifest depends on no
/// crate of the workspace but `dispatch-wire` (the gateway itself it cannot name: Cargo refuses
/// a cycle).
#[test]
fn the_fan_out_core_knows_no_application_type_beyond_the_wire() {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("crates/fanout/Cargo.toml");
    let manifest = std::fs::read_to_string(manifest).unwrap();
    let ours: Vec<&str> = manifest.lines().filter(|l| l.trim_start().starts_with("dispatch-")).collect();
    assert_eq!(ours, ["dispatch-wire = { path = \"../wire\" }"], "the core's own dependencies");
}

/// Inside each module (a folder), the files import one another (`super::<file>`) without a
/// cycle; `mod.rs` is the module itself, which its files may read.
#[test]
fn the_files_of_each_module_import_one_another_without_a_cycle() {
    let mut cycles = Vec::new();
    let mut folders: BTreeSet<(PathBuf, PathBuf)> = BTreeSet::new();
    for root in roots() {
        for file in files(&root) {
            folders.insert((root.clone(), file.parent().unwrap().to_owned()));
        }
    }
    for (root, folder) in folders {
        let inside: Vec<PathBuf> = std::fs::read_dir(&folder)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "rs") && p.file_stem().is_some_and(|s| s != "mod"))
            .collect();
        let names: BTreeSet<String> =
            inside.iter().map(|p| p.file_stem().unwrap().to_string_lossy().into_owned()).collect();
        let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for file in &inside {
            let from = file.file_stem().unwrap().to_string_lossy().into_owned();
            let to: Vec<String> =
                named_after(&code(file), "super::").into_iter().filter(|n| names.contains(n) && *n != from).collect();
            graph.entry(from).or_default().extend(to);
        }
        if let Some(around) = cycle(&graph) {
            cycles.push(format!("{}: {}", folder.strip_prefix(&root).unwrap().display(), around.join(" -> ")));
        }
    }
    assert!(cycles.is_empty(), "files that import in a cycle:\n{}", cycles.join("\n"));
}
