//! Runs one ignored test of the current test binary in a child process with
//! an environment of its own: the way a test needs environment variables set
//! (a test binary runs its tests on threads of one process, where
//! `std::env::set_var` is unsound). One file, included by path by the test
//! crates that use it.

/// Runs this binary's ignored test `name` alone in a child process, with the
/// variables `set` set and `unset` removed; panics with the child's output
/// unless it passes, and returns its stdout.
pub fn run_ignored_test_in_child(name: &str, set: &[(&str, &std::ffi::OsStr)], unset: &[&str]) -> String {
    run_ignored_test_in_child_with_stderr(name, set, unset).0
}

/// [`run_ignored_test_in_child`], returning the child's stdout and stderr
/// (where native libraries, such as the PJRT plugin, log).
pub fn run_ignored_test_in_child_with_stderr(
    name: &str,
    set: &[(&str, &std::ffi::OsStr)],
    unset: &[&str],
) -> (String, String) {
    let exe = std::env::current_exe().expect("the test binary");
    let mut cmd = std::process::Command::new(&exe);
    cmd.args(["--exact", name, "--ignored", "--nocapture", "--test-threads", "1"]);
    for (k, v) in set {
        cmd.env(k, v);
    }
    for k in unset {
        cmd.env_remove(k);
    }
    let out = cmd.output().unwrap_or_else(|e| panic!("running {}: {e}", exe.display()));
    let (so, se) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "the child test {name} failed ({}):\n{so}\n{se}", out.status);
    // libtest prints the counts; a filter that matched nothing would pass silently.
    assert!(so.contains("1 passed"), "the child ran no test named {name}:\n{so}");
    (so.into_owned(), se.into_owned())
}
