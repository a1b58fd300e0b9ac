//! Where agents and their tools may work (`cwd_roots`, docs/security.md): a folder a request names is
//! taken only inside the roots the configuration gives.

use std::path::{Path, PathBuf};

/// `roots` as they are now (symlinks followed); a root that cannot be read is left out, said
/// in the log with `owner` (the credential or server that names it).
pub fn canonical_roots(roots: &[PathBuf], owner: &str) -> Vec<PathBuf> {
    roots
        .iter()
        .filter_map(|root| match root.canonicalize() {
            Ok(root) => Some(root),
            Err(e) => {
                tracing::warn!(owner, root = %root.display(), error = %e, "a folder root cannot be read; left out");
                None
            }
        })
        .collect()
}

/// `cwd` resolved (against the first root when relative) and canonicalized, symlinks followed
/// and `..` gone, when it is a folder inside one of `roots` (themselves canonical).
pub fn inside(roots: &[PathBuf], cwd: &str) -> Option<PathBuf> {
    let asked = Path::new(cwd);
    let path = if asked.is_absolute() { asked.to_owned() } else { roots.first()?.join(asked) };
    let path = path.canonicalize().ok()?;
    (path.is_dir() && roots.iter().any(|root| path.starts_with(root))).then_some(path)
}

#[cfg(test)]
mod tests {
    #[test]
    fn an_agent_folder_lies_inside_a_root_once_resolved() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        std::fs::create_dir_all(root.join("project/sub")).unwrap();
        std::fs::create_dir_all(dir.path().join("outside")).unwrap();
        std::os::unix::fs::symlink(dir.path().join("outside"), root.join("escape")).unwrap();
        std::os::unix::fs::symlink(root.join("project"), root.join("alias")).unwrap();
        std::fs::write(root.join("file"), "").unwrap();
        let roots = vec![root.canonicalize().unwrap()];
        let at = |cwd: &str| super::inside(&roots, cwd);
        assert_eq!(at("project"), Some(roots[0].join("project")));
        assert_eq!(at("project/sub/.."), Some(roots[0].join("project")));
        assert_eq!(at("alias/sub"), Some(roots[0].join("project/sub")), "a symlink inside the root is followed");
        assert_eq!(at(root.to_str().unwrap()), Some(roots[0].clone()));
        for refused in
            ["/", "/root", "../../..", "..", "escape", "escape/.", "file", "missing", "project/../../outside"]
        {
            assert_eq!(at(refused), None, "{refused}");
        }
        assert_eq!(super::inside(&[], "project"), None, "no root, no folder");
    }
}
