//! The block allocator of the paged KV cache, with prefix sharing.

// Note [Prefix sharing]
// ~~~~~~~~~~~~~~~~~~~~~
// A full block's keys and values depend only on the tokens up to its end
// (attention is causal), so two sequences whose first `k * block_size`
// tokens agree can share their first `k` blocks. Every full block is
// registered under a hash chained over the blocks before it (and keeps its
// tokens, compared on every hit, so a hash collision can never hand out the
// wrong keys). A new request looks its prompt's full blocks up and starts
// computing after the ones found. Shared blocks are full, and a sequence
// only ever writes positions past its cached ones, in blocks it allocated
// itself: a shared block is never written, so copy-on-write never has to
// copy (`Blocks::check_writable` turns a violation into an error rather
// than a corrupted neighbour). A block whose last user finished stays
// registered and is reused by the next request with that prefix until the
// allocator needs it (least recently released first).
use kiln_tensor::{Error, Result};
use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};

/// The hash of a full block of `tokens` after the blocks hashed to `parent`.
pub fn block_hash(parent: u64, tokens: &[i64]) -> u64 {
    let mut h = DefaultHasher::new();
    parent.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

#[derive(Debug, Clone)]
struct Registered {
    hash: u64,
    tokens: Vec<i64>,
}

/// Reference-counted blocks of a pool of `n`.
#[derive(Debug)]
pub struct Blocks {
    refs: Vec<u32>,
    free: Vec<usize>,
    by_hash: HashMap<u64, usize>,
    key: Vec<Option<Registered>>,
    /// Registered blocks nobody uses, by release time (evicted oldest first).
    idle: BTreeMap<u64, usize>,
    idle_at: Vec<Option<u64>>,
    clock: u64,
    sharing: bool,
}

impl Blocks {
    /// A pool of `n` free blocks; `sharing` turns prefix sharing on.
    pub fn new(n: usize, sharing: bool) -> Blocks {
        Blocks {
            refs: vec![0; n],
            free: (0..n).rev().collect(),
            by_hash: HashMap::new(),
            key: vec![None; n],
            idle: BTreeMap::new(),
            idle_at: vec![None; n],
            clock: 0,
            sharing,
        }
    }

    /// Blocks in the pool.
    pub fn total(&self) -> usize {
        self.refs.len()
    }

    /// Blocks some sequence holds.
    pub fn used(&self) -> usize {
        self.refs.iter().filter(|&&r| r > 0).count()
    }

    /// Blocks that can be handed out now (free, or idle and evictable).
    pub fn available(&self) -> usize {
        self.free.len() + self.idle.len()
    }

    /// A block for one user: a free one, else the least recently released
    /// idle one (forgetting its prefix). `None` when every block is in use.
    pub fn allocate(&mut self) -> Option<usize> {
        let b = match self.free.pop() {
            Some(b) => b,
            None => {
                let (&t, &b) = self.idle.iter().next()?;
                self.idle.remove(&t);
                self.idle_at[b] = None;
                if let Some(r) = self.key[b].take() {
                    self.by_hash.remove(&r.hash);
                }
                b
            }
        };
        self.refs[b] = 1;
        Some(b)
    }

    /// One user lets go of `b`.
    pub fn release(&mut self, b: usize) {
        debug_assert!(self.refs[b] > 0, "block {b} released more often than taken");
        self.refs[b] = self.refs[b].saturating_sub(1);
        if self.refs[b] == 0 {
            if self.key[b].is_some() {
                self.clock += 1;
                self.idle.insert(self.clock, b);
                self.idle_at[b] = Some(self.clock);
            } else {
                self.free.push(b);
            }
        }
    }

    /// The registered block holding `tokens` after the prefix hashed to
    /// `parent`, taken for one more user; `None` if there is none.
    pub fn lookup(&mut self, parent: u64, tokens: &[i64]) -> Option<(usize, u64)> {
        if !self.sharing {
            return None;
        }
        let hash = block_hash(parent, tokens);
        let &b = self.by_hash.get(&hash)?;
        if self.key[b].as_ref().is_none_or(|r| r.tokens != tokens) {
            return None;
        }
        if let Some(t) = self.idle_at[b].take() {
            self.idle.remove(&t);
        }
        self.refs[b] += 1;
        Some((b, hash))
    }

    /// Registers the full block `b` (holding `tokens` after `parent`) for
    /// sharing; returns its hash.
    pub fn register(&mut self, b: usize, parent: u64, tokens: &[i64]) -> u64 {
        let hash = block_hash(parent, tokens);
        if self.sharing && self.key[b].is_none() && !self.by_hash.contains_key(&hash) {
            self.by_hash.insert(hash, b);
            self.key[b] = Some(Registered { hash, tokens: tokens.to_vec() });
        }
        hash
    }

    /// Errors unless `b` has exactly one user (Note [Prefix sharing]).
    pub fn check_writable(&self, b: usize) -> Result<()> {
        if self.refs[b] != 1 {
            return Err(Error::invalid(
                "serve",
                format!("KV block {b} is about to be written while {} sequences hold it", self.refs[b]),
            ));
        }
        Ok(())
    }
}
