//! Models loaded by repo id from a Hugging Face cache built here in the
//! standard layout (`models--org--name/{blobs,refs,snapshots}`), with no
//! network (Note [The Hugging Face cache]).
mod support;

use kiln::nn::io::hub::{cache_dir_from, is_repo_id, resolve_in};
use kiln::nn::models::LlamaForCausalLM;
use kiln::nn::module::Module;
use kiln::prelude::*;
use std::path::{Path, PathBuf};
use support::{fixture_dir, temp_dir};

const MAIN: &str = "0123456789abcdef0123456789abcdef01234567";
const OLD: &str = "fedcba9876543210fedcba9876543210fedcba98";

/// A cache holding `acme/tiny-llama` (the llama fixture) at two commits:
/// `refs/main` -> MAIN, `refs/v1` -> OLD; snapshot files link into `blobs/`
/// as huggingface_hub lays them out.
fn build_cache(tag: &str) -> PathBuf {
    let cache = temp_dir(tag).join("hub");
    let repo = cache.join("models--acme--tiny-llama");
    for d in ["blobs", "refs", &format!("snapshots/{MAIN}"), &format!("snapshots/{OLD}")] {
        std::fs::create_dir_all(repo.join(d)).unwrap();
    }
    for (i, f) in ["config.json", "model.safetensors"].iter().enumerate() {
        let blob = format!("blob{i}");
        std::fs::copy(fixture_dir("llama").join(f), repo.join("blobs").join(&blob)).unwrap();
        for c in [MAIN, OLD] {
            link(&Path::new("../../blobs").join(&blob), &repo.join("snapshots").join(c).join(f));
        }
    }
    std::fs::write(repo.join("refs/main"), MAIN).unwrap();
    std::fs::write(repo.join("refs/v1"), format!("{OLD}\n")).unwrap();
    cache
}

#[cfg(unix)]
fn link(target: &Path, at: &Path) {
    std::os::unix::fs::symlink(target, at).unwrap();
}

#[cfg(not(unix))]
fn link(target: &Path, at: &Path) {
    std::fs::copy(at.parent().unwrap().join(target), at).unwrap();
}

#[test]
fn cache_dir_follows_huggingface_hub_precedence() {
    let home = Some(PathBuf::from("/home/u"));
    let env = |vars: &'static [(&'static str, &'static str)]| {
        move |k: &str| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| PathBuf::from(v))
    };
    assert_eq!(cache_dir_from(env(&[]), home.clone()), Some(PathBuf::from("/home/u/.cache/huggingface/hub")));
    assert_eq!(
        cache_dir_from(env(&[("XDG_CACHE_HOME", "/x")]), home.clone()),
        Some(PathBuf::from("/x/huggingface/hub"))
    );
    const HF_HOME: &[(&str, &str)] = &[("HF_HOME", "/hf"), ("XDG_CACHE_HOME", "/x")];
    assert_eq!(cache_dir_from(env(HF_HOME), home.clone()), Some(PathBuf::from("/hf/hub")));
    const LEGACY: &[(&str, &str)] = &[("HUGGINGFACE_HUB_CACHE", "/legacy"), ("HF_HOME", "/hf")];
    assert_eq!(cache_dir_from(env(LEGACY), home.clone()), Some(PathBuf::from("/legacy")));
    const BOTH: &[(&str, &str)] = &[("HF_HUB_CACHE", "/c"), ("HUGGINGFACE_HUB_CACHE", "/legacy"), ("HF_HOME", "/hf")];
    assert_eq!(cache_dir_from(env(BOTH), home), Some(PathBuf::from("/c")));
    assert_eq!(cache_dir_from(env(&[]), None), None);
}

#[test]
fn repo_ids_are_recognised() {
    for ok in ["gpt2", "Qwen/Qwen3-0.6B", "meta-llama/Llama-3.2-1B", "a_b/c.d"] {
        assert!(is_repo_id(ok), "{ok}");
    }
    for bad in ["", "/abs/path", "a/b/c", "./local", "../up", "org/", "/name", "a--b/c", "a/-b", "a b/c", "a/b."] {
        assert!(!is_repo_id(bad), "{bad}");
    }
}

#[test]
fn revisions_resolve_through_refs_and_hashes() {
    let cache = build_cache("hub-resolve");
    let snap = |c: &str| cache.join("models--acme--tiny-llama/snapshots").join(c);
    assert_eq!(resolve_in(&cache, "acme/tiny-llama", "main").unwrap(), snap(MAIN));
    assert_eq!(resolve_in(&cache, "acme/tiny-llama", "v1").unwrap(), snap(OLD));
    assert_eq!(resolve_in(&cache, "acme/tiny-llama", OLD).unwrap(), snap(OLD));
    let err = |id: &str, rev: &str| resolve_in(&cache, id, rev).unwrap_err().to_string();
    let e = err("acme/other", "main");
    assert!(e.contains("not in the Hugging Face cache") && e.contains("huggingface-cli download acme/other"), "{e}");
    let e = err("acme/tiny-llama", "v2");
    assert!(e.contains("no revision \"v2\""), "{e}");
    let e = err("acme/tiny-llama", "../../../etc");
    assert!(e.contains("not a revision"), "{e}");
    let e = err("acme/tiny-llama", "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa");
    assert!(e.contains("no snapshot"), "{e}");
    let e = err("not/a/repo", "main");
    assert!(e.contains("not a Hugging Face repo id"), "{e}");
    // A ref that does not hold a commit hash is reported, not followed.
    std::fs::write(cache.join("models--acme--tiny-llama/refs/bad"), "../../x").unwrap();
    let e = err("acme/tiny-llama", "bad");
    assert!(e.contains("not a commit hash"), "{e}");
}

/// A repo id loads from the cache `HF_HUB_CACHE` names, offline; run in a
/// child process with that environment (`from_pretrained_by_repo_id_offline`).
#[test]
fn from_pretrained_loads_a_repo_id_from_the_cache_offline() {
    let cache = build_cache("hub-load");
    support::run_ignored_test_in_child(
        "from_pretrained_by_repo_id_offline",
        &[("HF_HUB_CACHE", cache.as_os_str()), ("HF_HUB_OFFLINE", "1".as_ref())],
        &["HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_OFFLINE"],
    );
}

#[test]
#[ignore = "a child process of from_pretrained_loads_a_repo_id_from_the_cache_offline"]
fn from_pretrained_by_repo_id_offline() -> Result<()> {
    assert!(std::env::var_os("HF_HUB_CACHE").is_some(), "run by its parent test, with a cache");
    let by_id = LlamaForCausalLM::from_pretrained("acme/tiny-llama", DType::F32, Device::Cpu)?;
    let by_dir = LlamaForCausalLM::from_pretrained(fixture_dir("llama"), DType::F32, Device::Cpu)?;
    let (a, b) = (by_id.named_parameters(), by_dir.named_parameters());
    assert_eq!(a.len(), b.len());
    for ((na, ta), (nb, tb)) in a.iter().zip(&b) {
        assert_eq!(na, nb);
        assert_eq!(ta.to_vec::<f32>()?, tb.to_vec::<f32>()?, "{na}");
    }
    let e = LlamaForCausalLM::from_pretrained("acme/missing", DType::F32, Device::Cpu).unwrap_err().to_string();
    assert!(e.contains("neither a directory nor a model in the cache") && e.contains("HF_HUB_OFFLINE"), "{e}");
    let e = LlamaForCausalLM::from_pretrained("no/such/dir", DType::F32, Device::Cpu).unwrap_err().to_string();
    assert!(e.contains("no/such/dir: no such directory"), "{e}");
    Ok(())
}
