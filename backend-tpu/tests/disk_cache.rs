//! The on-disk compile cache across processes: a second process loads what the
//! first compiled, a corrupt entry is detected and rebuilt, and processes
//! sharing the directory at once leave it consistent. The parent test runs
//! this binary's ignored `child` test in fresh processes.
mod support;

use kiln_tensor::{DType, Device, Tensor};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Runs in a child process: compiles (or loads) two programs, prints the counters.
#[test]
#[ignore = "a child process of the tests below"]
fn child() {
    assert!(std::env::var_os("KILN_DISK_CACHE_CHILD").is_some(), "run by the tests of this file, with a cache dir");
    kiln_cpu::register();
    kiln_tpu::register().unwrap();
    let x = Tensor::arange(0.0, 12.0, 1.0, (DType::F32, Device::Tpu(0))).unwrap().reshape(&[3, 4]).unwrap();
    let y = x.t().unwrap().sin().unwrap().sum_dim(1, false).unwrap();
    let v = y.to_vec::<f32>().unwrap();
    assert_eq!(v.len(), 4);
    let s = kiln_tpu::stats().unwrap();
    println!(
        "STATS compiles={} disk_hits={} disk_misses={} disk_rebuilt={}",
        s.compiles, s.disk_hits, s.disk_misses, s.disk_rebuilt
    );
}

struct Counts {
    compiles: u64,
    hits: u64,
    misses: u64,
    rebuilt: u64,
}

fn spawn(dir: &Path) -> std::process::Child {
    spawn_with(dir, None)
}

/// A child with `XLA_FLAGS` set to `xla_flags`, or unset.
fn spawn_with(dir: &Path, xla_flags: Option<&str>) -> std::process::Child {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    match xla_flags {
        Some(f) => cmd.env("XLA_FLAGS", f),
        None => cmd.env_remove("XLA_FLAGS"),
    };
    cmd.args(["--exact", "child", "--ignored", "--nocapture", "--test-threads=1"])
        .env("KILN_DISK_CACHE_CHILD", "1")
        .env("KILN_CACHE_DIR", dir)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap()
}

fn counts(out: std::process::Output) -> Counts {
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "child failed:\n{text}\n{}", String::from_utf8_lossy(&out.stderr));
    let line =
        text.lines().find_map(|l| l.find("STATS").map(|i| &l[i..])).unwrap_or_else(|| panic!("no STATS in:\n{text}"));
    let get = |k: &str| -> u64 {
        line.split_whitespace().find_map(|w| w.strip_prefix(&format!("{k}="))).unwrap().parse().unwrap()
    };
    Counts {
        compiles: get("compiles"),
        hits: get("disk_hits"),
        misses: get("disk_misses"),
        rebuilt: get("disk_rebuilt"),
    }
}

fn run(dir: &Path) -> Counts {
    counts(spawn(dir).wait_with_output().unwrap())
}

fn entries(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "kxe"))
        .collect();
    v.sort();
    v
}

#[test]
fn a_second_process_hits_the_disk_cache_and_corrupt_entries_are_rebuilt() {
    support::fetch_plugin();
    let dir = std::env::temp_dir().join(format!("kiln-disk-cache-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);

    let cold = run(&dir);
    assert!(cold.compiles >= 2 && cold.hits == 0 && cold.misses == cold.compiles, "cold start compiles");
    let files = entries(&dir);
    assert_eq!(files.len() as u64, cold.compiles, "one entry per program");
    assert!(std::fs::read_dir(&dir).unwrap().all(|e| !e.unwrap().file_name().to_string_lossy().starts_with(".tmp")));

    let warm = run(&dir);
    assert_eq!(warm.compiles, 0, "a warm start compiles nothing");
    assert_eq!(warm.hits, cold.compiles);

    // Other compiler flags make other programs: not served from entries compiled without them.
    let flags = Some("--xla_cpu_enable_fast_math=false");
    let flagged = counts(spawn_with(&dir, flags).wait_with_output().unwrap());
    assert_eq!((flagged.compiles, flagged.hits), (cold.compiles, 0), "XLA_FLAGS is part of the key");
    assert_eq!(counts(spawn_with(&dir, flags).wait_with_output().unwrap()).compiles, 0);

    // Corrupt one entry of the unflagged programs (flip a byte of its payload) and truncate another.
    let mut bytes = std::fs::read(&files[0]).unwrap();
    let n = bytes.len();
    bytes[n - 10] ^= 0x5a;
    std::fs::write(&files[0], bytes).unwrap();
    let b1 = std::fs::read(&files[1]).unwrap();
    std::fs::write(&files[1], &b1[..b1.len() / 2]).unwrap();
    let repaired = run(&dir);
    assert_eq!(repaired.rebuilt, 2, "both bad entries are detected");
    assert_eq!(repaired.compiles, 2, "and compiled again");
    assert_eq!(run(&dir).compiles, 0, "the rewritten entries load again");

    // Processes sharing a cold directory at once: all succeed, the directory stays consistent.
    let shared = dir.join("shared");
    let kids: Vec<_> = (0..3).map(|_| spawn(&shared)).collect();
    for k in kids {
        counts(k.wait_with_output().unwrap());
    }
    let after = run(&shared);
    assert_eq!(after.compiles, 0, "every entry written concurrently is whole");
    let _ = std::fs::remove_dir_all(&dir);
}
