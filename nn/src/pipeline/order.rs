//! The order of a pipeline schedule's work: which stage runs which
//! microbatch's forward or backward, in what order on each rank (PyTorch's
//! `_Action`s), and a timeline of that order under given costs, from which
//! the bubble, the dispatch order and the activations each stage holds follow.
use kiln_tensor::{Error, Result};

/// Forward or backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Phase {
    /// The stage's forward on one microbatch.
    Forward,
    /// The stage's backward on one microbatch (input and weight gradients).
    Backward,
}

/// One unit of a schedule: `phase` of `stage` on `microbatch`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Action {
    /// The stage (0 is the first of the model).
    pub stage: usize,
    /// The microbatch.
    pub microbatch: usize,
    /// Forward or backward.
    pub phase: Phase,
}

impl Action {
    fn f(stage: usize, microbatch: usize) -> Action {
        Action { stage, microbatch, phase: Phase::Forward }
    }
    fn b(stage: usize, microbatch: usize) -> Action {
        Action { stage, microbatch, phase: Phase::Backward }
    }
}

/// The schedules, with the names of PyTorch's `torch.distributed.pipelining`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScheduleKind {
    /// Every microbatch's forward, then every backward (`ScheduleGPipe`).
    GPipe,
    /// Warm-up forwards, then one forward and one backward in turn (`Schedule1F1B`).
    OneFOneB,
    /// 1F1B over several stages per rank, placed round-robin (stage `s` on
    /// rank `s % p`), which shrinks the bubble by the stages per rank
    /// (`ScheduleInterleaved1F1B`, Megatron-LM's order).
    Interleaved1F1B,
}

impl ScheduleKind {
    /// The name PyTorch gives the schedule (`--schedule` takes `gpipe`, `1f1b`, `interleaved`).
    pub fn parse(s: &str) -> Result<ScheduleKind> {
        match s {
            "gpipe" => Ok(ScheduleKind::GPipe),
            "1f1b" => Ok(ScheduleKind::OneFOneB),
            "interleaved" | "interleaved1f1b" => Ok(ScheduleKind::Interleaved1F1B),
            _ => {
                Err(Error::invalid("pipeline", format!("unknown schedule {s:?}: expected gpipe, 1f1b or interleaved")))
            }
        }
    }
}

/// Each rank's actions in the order it runs them, for `ranks` ranks holding
/// `stages_per_rank` stages each (stage `s` on rank `s % ranks`) and
/// `microbatches` microbatches.
pub fn rank_orders(
    kind: ScheduleKind,
    ranks: usize,
    stages_per_rank: usize,
    microbatches: usize,
) -> Result<Vec<Vec<Action>>> {
    let (p, v, m) = (ranks, stages_per_rank, microbatches);
    if p == 0 || v == 0 || m == 0 {
        return Err(Error::invalid(
            "pipeline",
            format!("a schedule needs at least one rank, stage and microbatch, got {p} ranks, {v} stages per rank and {m} microbatches"),
        ));
    }
    match kind {
        ScheduleKind::GPipe | ScheduleKind::OneFOneB if v != 1 => Err(Error::invalid(
            "pipeline",
            format!("{kind:?} runs one stage per rank, got {v}; use the interleaved schedule for more"),
        )),
        ScheduleKind::GPipe => Ok((0..p)
            .map(|r| (0..m).map(|i| Action::f(r, i)).chain((0..m).map(|i| Action::b(r, i))).collect())
            .collect()),
        ScheduleKind::OneFOneB => Ok((0..p)
            .map(|r| {
                let warmup = (p - 1 - r).min(m);
                one_f_one_b(m, warmup, |i| Action::f(r, i), |i| Action::b(r, i))
            })
            .collect()),
        ScheduleKind::Interleaved1F1B => {
            if !m.is_multiple_of(p) {
                return Err(Error::invalid(
                    "pipeline",
                    format!(
                        "the interleaved schedule needs the microbatches ({m}) to be a multiple of the ranks ({p})"
                    ),
                ));
            }
            // Microbatches go through the rank's stages in groups of `p`:
            // the k-th forward is microbatch `mb(k)` on the rank's chunk
            // `(k / p) % v`; backwards walk the chunks in reverse.
            let mb = |k: usize| (k / (p * v)) * p + k % p;
            Ok((0..p)
                .map(|r| {
                    let warmup = ((p - r - 1) * 2 + (v - 1) * p).min(m * v);
                    one_f_one_b(
                        m * v,
                        warmup,
                        |k| Action::f(((k / p) % v) * p + r, mb(k)),
                        |k| Action::b((v - 1 - (k / p) % v) * p + r, mb(k)),
                    )
                })
                .collect())
        }
    }
}

/// `warmup` forwards, then a forward and a backward in turn, then the
/// remaining backwards: `n` of each, the i-th made by `f(i)` / `b(i)`.
fn one_f_one_b(n: usize, warmup: usize, f: impl Fn(usize) -> Action, b: impl Fn(usize) -> Action) -> Vec<Action> {
    let mut out: Vec<Action> = (0..warmup).map(&f).collect();
    for i in 0..n - warmup {
        out.push(f(warmup + i));
        out.push(b(i));
    }
    out.extend((n - warmup..n).map(b));
    out
}

/// When each action runs if every action of a phase costs the same on every
/// stage and ranks run their orders as soon as their inputs are there.
#[derive(Debug, Clone)]
pub struct Timeline {
    /// `(start, end, rank, action)` in order of start (ties by rank).
    pub runs: Vec<(f64, f64, usize, Action)>,
    /// When the last action ends.
    pub makespan: f64,
    /// Each rank's busy time.
    pub busy: Vec<f64>,
}

impl Timeline {
    /// The fraction of rank time spent idle: `1 - busy / (ranks * makespan)`.
    pub fn bubble_fraction(&self) -> f64 {
        let total: f64 = self.busy.iter().sum();
        1.0 - total / (self.busy.len() as f64 * self.makespan)
    }
}

/// The timeline of `orders` over `stages` stages with a forward costing
/// `t_forward` and a backward `t_backward` (the costs of a rank's stages
/// alike). A forward waits for the previous stage's forward of its
/// microbatch, a backward for its own stage's forward and the next stage's
/// backward. An order that can never finish (a rank waiting on work
/// another rank only does after it) is an error.
pub fn simulate(orders: &[Vec<Action>], stages: usize, t_forward: f64, t_backward: f64) -> Result<Timeline> {
    simulate_with(orders, stages, |a| if a.phase == Phase::Forward { t_forward } else { t_backward })
}

/// [`simulate`] with each action's own cost (measured ones, say).
pub fn simulate_with(orders: &[Vec<Action>], stages: usize, cost: impl Fn(&Action) -> f64) -> Result<Timeline> {
    use std::collections::HashMap;
    let mut done: HashMap<(usize, usize, bool), f64> = HashMap::new();
    let mut next = vec![0usize; orders.len()];
    let mut free = vec![0.0f64; orders.len()];
    let mut busy = vec![0.0f64; orders.len()];
    let mut runs = vec![];
    let total: usize = orders.iter().map(Vec::len).sum();
    while runs.len() < total {
        let mut progressed = false;
        for (r, order) in orders.iter().enumerate() {
            let Some(&a) = order.get(next[r]) else { continue };
            if a.stage >= stages {
                return Err(Error::invalid("pipeline", format!("{a:?} names a stage past the {stages} there are")));
            }
            let deps: Vec<(usize, usize, bool)> = match a.phase {
                Phase::Forward if a.stage == 0 => vec![],
                Phase::Forward => vec![(a.stage - 1, a.microbatch, true)],
                Phase::Backward if a.stage + 1 == stages => vec![(a.stage, a.microbatch, true)],
                Phase::Backward => vec![(a.stage, a.microbatch, true), (a.stage + 1, a.microbatch, false)],
            };
            let Some(ready) = deps.iter().map(|d| done.get(d).copied()).try_fold(0.0f64, |t, d| Some(t.max(d?))) else {
                continue;
            };
            let cost = cost(&a);
            let start = ready.max(free[r]);
            free[r] = start + cost;
            busy[r] += cost;
            done.insert((a.stage, a.microbatch, a.phase == Phase::Forward), start + cost);
            runs.push((start, start + cost, r, a));
            next[r] += 1;
            progressed = true;
        }
        if !progressed {
            let stuck: Vec<String> = orders
                .iter()
                .enumerate()
                .filter_map(|(r, o)| Some(format!("rank {r} at {:?}", o.get(next[r])?)))
                .collect();
            return Err(Error::invalid("pipeline", format!("the schedule deadlocks: {}", stuck.join(", "))));
        }
    }
    runs.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.2.cmp(&b.2)));
    let makespan = free.iter().copied().fold(0.0, f64::max);
    Ok(Timeline { runs, makespan, busy })
}

/// For each stage, the most microbatches whose forward has run and whose
/// backward has not, in the order its rank runs them: the activations the
/// stage holds at its peak.
pub fn peak_in_flight(orders: &[Vec<Action>], stages: usize) -> Vec<usize> {
    let mut now = vec![0usize; stages];
    let mut peak = vec![0usize; stages];
    for a in orders.iter().flatten() {
        match a.phase {
            Phase::Forward => {
                now[a.stage] += 1;
                peak[a.stage] = peak[a.stage].max(now[a.stage]);
            }
            Phase::Backward => now[a.stage] = now[a.stage].saturating_sub(1),
        }
    }
    peak
}

#[cfg(test)]
mod tests;
