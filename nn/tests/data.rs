//! Data tests: tokenizers (bytes, a Hugging Face `tokenizer.json`), the
//! train/validation split, the batch loader (shapes, epochs as permutations,
//! seeding, saved positions) and the addition corpus.
use kiln::nn::data::{
    inputs_targets, load_tokenizer, read_tokens, train_val_split, AdditionTask, ByteTokenizer, HfTokenizer,
    LoaderState, SeededRng, TokenLoader, Tokenizer,
};
use std::collections::BTreeSet;

/// The rows of a batch as token vectors.
fn rows(batch: &kiln::Tensor) -> Vec<Vec<i64>> {
    let w = batch.shape()[1];
    batch.to_vec::<i64>().unwrap().chunks(w).map(<[i64]>::to_vec).collect()
}

fn counting(n: u32) -> Vec<u32> {
    (0..n).collect()
}

#[test]
fn byte_tokenizer_round_trips_any_text() {
    let t = ByteTokenizer;
    assert_eq!(t.vocab_size(), 256);
    let text = "To be, or not to be: ça, 🦀\n";
    let ids = t.encode(text).unwrap();
    assert_eq!(ids.len(), text.len());
    assert_eq!(ids[..3], [84, 111, 32]);
    assert_eq!(t.decode(&ids).unwrap(), text);
    let e = t.decode(&[72, 300]).unwrap_err().to_string();
    assert!(e.contains("token id 300 is not a byte"), "{e}");
    assert_eq!(t.decode(&[0xff]).unwrap(), "\u{fffd}");
}

const WORD_LEVEL: &str = r#"{
  "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
  "normalizer": {"type": "Lowercase"},
  "pre_tokenizer": {"type": "Whitespace"},
  "post_processor": null, "decoder": null,
  "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "hello": 1, "world": 2, "!": 3, ",": 4}, "unk_token": "[UNK]"}
}"#;

#[test]
fn hugging_face_tokenizer_json_loads_and_encodes() {
    let t = HfTokenizer::from_json(WORD_LEVEL).unwrap();
    assert_eq!(t.vocab_size(), 5);
    // Lowercased, split by the pre-tokenizer's regex, unknown words -> [UNK].
    assert_eq!(t.encode("Hello, world! Goodbye").unwrap(), [1, 4, 2, 3, 0]);
    assert_eq!(t.decode(&[1, 2, 3]).unwrap(), "hello world !");
    // From a file, through `load_tokenizer` and `read_tokens`.
    let dir = std::env::temp_dir().join(format!("kiln-data-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("tokenizer.json"), WORD_LEVEL).unwrap();
    std::fs::write(dir.join("text.txt"), "hello hello world").unwrap();
    let t = load_tokenizer(Some(&dir.join("tokenizer.json"))).unwrap();
    assert_eq!(read_tokens(dir.join("text.txt"), &*t).unwrap(), [1, 1, 2]);
    assert_eq!(load_tokenizer(None).unwrap().vocab_size(), 256);
    let e = load_tokenizer(Some(&dir.join("missing.json"))).err().unwrap().to_string();
    assert!(e.contains("cannot read the tokenizer") && e.contains("missing.json"), "{e}");
    let e = read_tokens(dir.join("nope.txt"), &ByteTokenizer).unwrap_err().to_string();
    assert!(e.contains("cannot read") && e.contains("nope.txt"), "{e}");
    assert!(HfTokenizer::from_json("{").is_err());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn train_val_split_keeps_the_tail_for_validation() {
    let (tr, va) = train_val_split(&counting(100), 0.1).unwrap();
    assert_eq!((tr.len(), va.len()), (90, 10));
    assert_eq!((tr[89], va[0]), (89, 90));
    let (tr, va) = train_val_split(&counting(10), 0.0).unwrap();
    assert_eq!((tr.len(), va.len()), (10, 0));
    assert!(train_val_split(&counting(10), 1.0).is_err());
}

#[test]
fn batches_are_windows_with_their_next_token() {
    let mut l = TokenLoader::new(counting(101), 2, 10).unwrap().with_shuffle(false);
    assert_eq!((l.windows(), l.batches_per_epoch(), l.batch_shape()), (10, 5, (2, 10)));
    let b = l.next_batch().unwrap();
    assert_eq!((b.shape(), b.dtype()), (&[2, 11][..], kiln::DType::I64));
    assert_eq!(rows(&b), [(0..=10).collect::<Vec<i64>>(), (10..=20).collect()]);
    let (x, y) = inputs_targets(&b).unwrap();
    assert_eq!(rows(&x)[1], (10..20).collect::<Vec<i64>>());
    assert_eq!(rows(&y)[1], (11..=20).collect::<Vec<i64>>());
    assert!(inputs_targets(&kiln::Tensor::zeros(&[3], kiln::DType::I64).unwrap()).is_err());
}

#[test]
fn an_epoch_visits_every_window_once_in_a_seeded_order() {
    let epoch = |l: &mut TokenLoader| -> Vec<i64> {
        (0..l.batches_per_epoch()).flat_map(|_| rows(&l.next_batch().unwrap())).map(|r| r[0] / 4).collect()
    };
    let mut l = TokenLoader::new(counting(4 * 30 + 1), 3, 4).unwrap().with_seed(11);
    let e0 = epoch(&mut l);
    assert_eq!(e0.iter().copied().collect::<BTreeSet<_>>(), (0..30).collect(), "a permutation");
    assert_ne!(e0, (0..30).collect::<Vec<_>>(), "shuffled");
    assert_eq!(l.epoch(), 0);
    let e1 = epoch(&mut l);
    assert_eq!(l.epoch(), 1);
    assert_ne!(e0, e1, "each epoch has its own order");
    // The same seed gives the same order, another seed another.
    let mut again = TokenLoader::new(counting(4 * 30 + 1), 3, 4).unwrap().with_seed(11);
    assert_eq!(epoch(&mut again), e0);
    let mut other = TokenLoader::new(counting(4 * 30 + 1), 3, 4).unwrap().with_seed(12);
    assert_ne!(epoch(&mut other), e0);
    // An incomplete last batch is dropped: 30 windows, batches of 4 -> 7 batches.
    let l = TokenLoader::new(counting(4 * 30 + 1), 4, 4).unwrap();
    assert_eq!(l.batches_per_epoch(), 7);
}

#[test]
fn a_saved_position_continues_the_same_stream() {
    let mut a = TokenLoader::new(counting(500), 4, 7).unwrap().with_seed(3);
    let n = a.batches_per_epoch();
    for _ in 0..n + 2 {
        a.next_batch().unwrap();
    }
    let saved = a.state();
    assert_eq!(saved, LoaderState { seed: 3, epoch: 1, batch: 2 });
    let json = saved.to_json();
    let want: Vec<Vec<Vec<i64>>> = (0..n + 3).map(|_| rows(&a.next_batch().unwrap())).collect();
    let mut b = TokenLoader::new(counting(500), 4, 7).unwrap();
    b.set_state(LoaderState::from_json(&json).unwrap()).unwrap();
    let got: Vec<Vec<Vec<i64>>> = (0..n + 3).map(|_| rows(&b.next_batch().unwrap())).collect();
    assert_eq!(got, want);
    let e = b.set_state(LoaderState { seed: 0, epoch: 0, batch: 1000 }).unwrap_err().to_string();
    assert!(e.contains("past the end of an epoch"), "{e}");
    assert!(LoaderState::from_json(&serde_json::json!({"seed": 1})).is_err());
    // Seeds survive JSON exactly, even above 2^53.
    let big = LoaderState { seed: u64::MAX - 1, epoch: 2, batch: 0 };
    assert_eq!(LoaderState::from_json(&big.to_json()).unwrap(), big);
}

#[test]
fn sequential_batches_cover_every_window_in_order() {
    let l = TokenLoader::new(counting(51), 3, 5).unwrap();
    let starts: Vec<i64> = l.sequential_batches().flat_map(|b| rows(&b.unwrap())).map(|r| r[0]).collect();
    assert_eq!(starts, (0..10).map(|i| i * 5).collect::<Vec<i64>>());
    assert_eq!(l.sequential_batches().last().unwrap().unwrap().shape(), &[1, 6], "last batch is smaller");
}

#[test]
fn too_little_text_is_a_clear_error() {
    let e = TokenLoader::new(counting(20), 4, 8).unwrap_err().to_string();
    assert!(e.contains("20 tokens make 2 windows of 8+1 tokens, fewer than one batch of 4"), "{e}");
    assert!(TokenLoader::new(counting(20), 0, 8).is_err());
}

#[test]
fn seeded_rng_is_deterministic_and_unbiased_enough() {
    let mut a = SeededRng::new(42);
    let mut b = SeededRng::new(42);
    let xs: Vec<u64> = (0..5).map(|_| a.next_u64()).collect();
    assert_eq!(xs, (0..5).map(|_| b.next_u64()).collect::<Vec<_>>());
    let mut counts = [0usize; 10];
    for _ in 0..10_000 {
        counts[a.below(10) as usize] += 1;
    }
    assert!(counts.iter().all(|&c| (800..1200).contains(&c)), "{counts:?}");
    let mut v: Vec<u32> = (0..50).collect();
    a.shuffle(&mut v);
    assert_ne!(v, (0..50).collect::<Vec<_>>());
    v.sort();
    assert_eq!(v, (0..50).collect::<Vec<_>>());
}

#[test]
fn addition_corpus_is_deterministic_and_holds_problems_out() {
    let task = AdditionTask::new(3, 5);
    assert_eq!(AdditionTask::line(999, 1), "999+1=1000\n");
    assert_eq!((AdditionTask::prompt(12, 30), AdditionTask::answer(12, 30)), ("12+30=".to_string(), "42".to_string()));
    let text = task.training_text(3000);
    assert_eq!(text, task.training_text(3000), "deterministic");
    assert_ne!(text, AdditionTask::new(3, 6).training_text(3000), "seeded");
    let mut seen = BTreeSet::new();
    for line in text.lines() {
        let (q, ans) = line.split_once('=').unwrap();
        let (a, b) = q.split_once('+').unwrap();
        let (a, b): (u64, u64) = (a.parse().unwrap(), b.parse().unwrap());
        assert!(a < 1000 && b < 1000);
        assert_eq!(ans.parse::<u64>().unwrap(), a + b);
        assert!(!task.is_held_out(a, b), "{line} is held out");
        seen.insert((a, b));
    }
    assert!(seen.len() > 2900, "mostly distinct problems");
    let held = task.held_out_problems(500);
    assert_eq!(held.len(), 500);
    assert_eq!(held, task.held_out_problems(500));
    assert_eq!(held.iter().collect::<BTreeSet<_>>().len(), 500, "distinct");
    assert!(held.iter().all(|&(a, b)| task.is_held_out(a, b) && !seen.contains(&(a, b))));
    // About 10% of all pairs are held out.
    let share = (0..1000u64).filter(|&i| task.is_held_out(i / 37, i % 211)).count();
    assert!((60..140).contains(&share), "{share}");
    // One-digit problems: the held-out set is small, but not empty.
    let small = AdditionTask::new(1, 0);
    let all = small.held_out_problems(1000);
    assert!(!all.is_empty() && all.len() < 30, "{}", all.len());
    // Scoring.
    assert!(AdditionTask::is_correct(12, 30, "42\n7+"));
    assert!(AdditionTask::is_correct(12, 30, "42"));
    assert!(!AdditionTask::is_correct(12, 30, "421\n"));
    assert!(!AdditionTask::is_correct(12, 30, "4"));
}
