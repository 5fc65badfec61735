//! The layering the code keeps, read from its sources: no file of the PJRT
//! backend imports one that imports it (directly or through others), and
//! kiln-tensor's `op/` (what the primitives are) imports nothing above it:
//! only the core types, and `custom` for `Op::Custom`.
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Every `.rs` file under `dir`, recursively.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = vec![];
    for e in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(rust_files(&p));
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
    out.sort();
    out
}

/// The names a source file reaches at the crate's top level: `crate::name`
/// paths and the items of `use crate::{a, b::c}` lists (comments left out).
fn crate_refs(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let code: String = text
        .lines()
        .map(|l| match l.find("//") {
            Some(i) => &l[..i],
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n");
    let ident = |s: &str| s.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect::<String>();
    let mut rest = code.as_str();
    while let Some(i) = rest.find("crate::") {
        rest = &rest[i + "crate::".len()..];
        if let Some(list) = rest.strip_prefix('{') {
            // Top-level items of the braced list (nested braces skipped).
            let (mut depth, mut item) = (0, String::new());
            for c in list.chars() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        out.insert(ident(item.trim()));
                        item.clear();
                    }
                    _ if depth == 0 => item.push(c),
                    _ => {}
                }
            }
            out.insert(ident(item.trim()));
        } else {
            out.insert(ident(rest));
        }
    }
    out.remove("");
    out
}

/// The top-level module of a file of `src` (`lower/mesh.rs` is `lower`).
fn module_of(src: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(src).unwrap();
    let first = rel.components().next().unwrap().as_os_str().to_string_lossy().to_string();
    first.trim_end_matches(".rs").to_string()
}

/// A cycle in `edges`, if there is one, as the modules along it.
fn find_cycle(edges: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        n: &str,
        edges: &BTreeMap<String, BTreeSet<String>>,
        state: &mut BTreeMap<String, u8>,
        path: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        match state.get(n) {
            Some(1) => {
                let i = path.iter().position(|p| p == n).unwrap();
                let mut cycle = path[i..].to_vec();
                cycle.push(n.to_string());
                return Some(cycle);
            }
            Some(2) => return None,
            _ => {}
        }
        state.insert(n.to_string(), 1);
        path.push(n.to_string());
        for m in edges.get(n).into_iter().flatten() {
            if let Some(c) = visit(m, edges, state, path) {
                return Some(c);
            }
        }
        path.pop();
        state.insert(n.to_string(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for n in edges.keys() {
        if let Some(c) = visit(n, edges, &mut state, &mut vec![]) {
            return Some(c);
        }
    }
    None
}

#[test]
fn no_file_of_the_pjrt_backend_imports_one_that_imports_it() {
    let src = root().join("backend-tpu/src");
    let files = rust_files(&src);
    let modules: BTreeSet<String> = files.iter().map(|f| module_of(&src, f)).filter(|m| m != "lib").collect();
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for f in &files {
        let m = module_of(&src, f);
        if m == "lib" {
            continue;
        }
        let refs = crate_refs(&std::fs::read_to_string(f).unwrap());
        let deps = edges.entry(m.clone()).or_default();
        deps.extend(refs.into_iter().filter(|r| *r != m && modules.contains(r)));
    }
    assert!(edges.get("buffer").is_some_and(|d| !d.contains("backend")), "buffer imports the backend: {edges:?}");
    assert!(edges.get("dist").is_some_and(|d| d.contains("buffer")), "the reader sees dist's imports: {edges:?}");
    if let Some(cycle) = find_cycle(&edges) {
        panic!("backend-tpu's files import each other: {}\n(all: {edges:#?})", cycle.join(" -> "));
    }
}

#[test]
fn op_imports_nothing_above_it() {
    let src = root().join("tensor/src");
    // The core types below the primitives, and `custom` for `Op::Custom`
    // (its trait's gradient is written in tensor ops).
    let allowed: BTreeSet<&str> = [
        "alloc", "error", "dtype", "layout", "scalar", "float8", "op", "custom", "DType", "Error", "Result", "Layout",
        "Shape", "Strides", "Scalar", "Meta", "f8e4m3fn", "f8e5m2",
    ]
    .into_iter()
    .collect();
    let mut files = vec![src.join("op.rs")];
    files.extend(rust_files(&src.join("op")));
    let mut seen = 0;
    for f in &files {
        let refs = crate_refs(&std::fs::read_to_string(f).unwrap());
        seen += refs.len();
        let above: Vec<&String> = refs.iter().filter(|r| !allowed.contains(r.as_str())).collect();
        assert!(above.is_empty(), "{} imports {above:?} from above op/", f.display());
    }
    assert!(seen > 10, "the reader found the imports ({seen})");
}

#[test]
fn the_reader_finds_paths_and_lists() {
    let refs = crate_refs("use crate::{a::X, b, c::{d, e}};\nlet x = crate::f::g(); // crate::h\n");
    let want: BTreeSet<String> = ["a", "b", "c", "f"].iter().map(|s| s.to_string()).collect();
    assert_eq!(refs, want);
    let mut edges = BTreeMap::new();
    edges.insert("a".to_string(), ["b".to_string()].into_iter().collect::<BTreeSet<_>>());
    edges.insert("b".to_string(), ["a".to_string()].into_iter().collect());
    assert_eq!(find_cycle(&edges), Some(vec!["a".to_string(), "b".to_string(), "a".to_string()]));
}
