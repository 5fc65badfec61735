//! Teams of compute threads: a loop run through `on_compute_threads` keeps the
//! pool's other threads awake and hands them each op's parallel parts without
//! a cross-thread wake-up (Note [Teams of compute threads]).
use std::any::Any;
use std::cell::{Cell, RefCell};
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering::*};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

// Note [Teams of compute threads]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A decoding step is hundreds of ops; the large ones (products, attention)
// split across the pool and the small ones between them run on the calling
// thread. With rayon alone, a pool thread that finds no work yields a few
// dozen times (tens of microseconds) and then sleeps on a futex, so nearly
// every product of a step woke a sleeping thread, and the thread that forked
// slept too whenever its part finished first. On the 2-vCPU VMs this was
// measured on, a wake-up costs 40-90 µs (the idle vCPU halts and waits for an
// interrupt through the hypervisor): a `rayon::join` of two 100 µs halves
// after 100 µs of serial work took 185 µs instead of 100; with the other
// thread spinning, 108. A Qwen3-0.6B step had ~300 such sleeps per token.
//
// `lead(f)` (what `on_compute_threads` runs on the CPU) makes the calling pool
// thread the leader of a team and recruits the pool's other threads as
// helpers (`rayon::spawn_broadcast`: a wake-up per loop, not per op). A helper
// spins: it watches the team's job slot and, between jobs, runs whatever
// rayon work is pending (`rayon::yield_now`), so kernels that still use rayon
// directly (gemm's own threading, sorts) lose nothing. `fork(tasks, f)` (the
// fork of every helper in `kernels/iter.rs`) posts a job when the calling
// thread leads a team: the leader and the helpers claim task indices from one
// counter; once none is left, the leader empties the job slot and spins until
// no helper is inside the job, so every task is done when `fork` returns.
// Elsewhere `fork` is rayon's parallel loop, as before.
//
// Rules that keep it safe:
// - The leader never waits for a helper to arrive, only for tasks a helper
//   has claimed, which are kernel bodies that take no locks; a team with no
//   helpers (all busy elsewhere) runs every task on the leader.
// - The job lives on the leader's stack. A helper announces itself in
//   `active` before reading the slot; the leader empties the slot, then waits
//   for `active` to reach zero, so no helper can reach a job that is gone
//   (both sides `SeqCst`: either the helper sees the empty slot, or the
//   leader sees the helper). Panics in tasks are caught on every thread, the
//   leader waits as usual, then resumes the first panic.
// - A thread that leads or helps a team does not lead or help another (a
//   helper job it meets is dropped at once; a nested `lead` runs `f` in
//   place); a task that forks again runs its parts in place (on the leader)
//   or through rayon (on a helper).
// - A helper with nothing to do for `IDLE` goes back to rayon's pool, where it
//   sleeps as rayon threads do; the leader's next fork recruits it again, and
//   the helper, once awake, joins the job that fork posted (a large op is one
//   long job: a helper that waited for the next one left before it came). A
//   loop that waits on something else (a user's callback, a slow client)
//   therefore spins a core for at most that long.

/// How long a helper spins without work before it leaves the team.
const IDLE: Duration = Duration::from_millis(2);

/// The team the calling thread leads or helps.
pub(crate) struct Team {
    /// Bumped once per posted job; helpers compare it with the last they saw.
    epoch: AtomicU64,
    /// The job being run, or null (it lives on the leader's stack).
    job: AtomicPtr<Job<'static>>,
    /// Helpers that may be reading `job`.
    active: AtomicUsize,
    /// Helpers in their loop.
    helpers: AtomicUsize,
    /// When helper jobs were last sent (`Instant` of the team's start + nanoseconds).
    recruited: AtomicU64,
    start: Instant,
    /// How many helpers the team wants (the pool's threads but the leader).
    wanted: usize,
    stop: AtomicBool,
}

/// One posted fork: `f(i)` for every `i < tasks`.
struct Job<'a> {
    f: &'a (dyn Fn(usize) + Sync),
    tasks: usize,
    next: AtomicUsize,
    panic: Mutex<Option<Box<dyn Any + Send>>>,
}

/// What the calling thread is to a team.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    None,
    /// Leads a team (the team itself sits in `LEADING`).
    Leader,
    /// Leads a team and is running one of its job's tasks.
    LeaderInJob,
    Helper,
}

thread_local! {
    static ROLE: Cell<Role> = const { Cell::new(Role::None) };
    static LEADING: RefCell<Option<Arc<Team>>> = const { RefCell::new(None) };
}

/// Restores the thread's role (and drops the team it led) on every exit, unwinding included.
struct RoleGuard(Role);

impl Drop for RoleGuard {
    fn drop(&mut self) {
        if ROLE.with(|r| r.replace(self.0)) == Role::Leader {
            if let Some(team) = LEADING.with(|l| l.borrow_mut().take()) {
                team.stop.store(true, Release);
            }
        }
    }
}

/// Runs `f` as the leader of a team of the pool's threads, or in place when
/// this thread already leads or helps one, or the pool has one thread.
pub(crate) fn lead<R>(f: impl FnOnce() -> R) -> R {
    let wanted = rayon::current_num_threads().saturating_sub(1);
    if ROLE.with(Cell::get) != Role::None || wanted == 0 {
        return f();
    }
    let team = Arc::new(Team {
        epoch: AtomicU64::new(0),
        job: AtomicPtr::new(std::ptr::null_mut()),
        active: AtomicUsize::new(0),
        helpers: AtomicUsize::new(0),
        recruited: AtomicU64::new(0),
        start: Instant::now(),
        wanted,
        stop: AtomicBool::new(false),
    });
    team.recruit();
    LEADING.with(|l| *l.borrow_mut() = Some(team));
    ROLE.with(|r| r.set(Role::Leader));
    let _guard = RoleGuard(Role::None);
    f()
}

/// Runs `f(i)` for every `i < tasks` across the compute threads: through the
/// team when this thread leads one, in place inside a team's task, else
/// rayon's parallel loop. Panics in `f` reach the caller.
pub(crate) fn fork(tasks: usize, f: &(dyn Fn(usize) + Sync)) {
    use rayon::prelude::*;
    match ROLE.with(Cell::get) {
        _ if tasks <= 1 => (0..tasks).for_each(f),
        Role::Leader => {
            let team = LEADING.with(|l| l.borrow().clone()).expect("a leader holds its team");
            team.run(tasks, f);
        }
        Role::LeaderInJob => (0..tasks).for_each(f),
        Role::None | Role::Helper => (0..tasks).into_par_iter().for_each(f),
    }
}

impl Team {
    /// Sends every pool thread a helper job: one each, as a job meant for one
    /// thread cannot be taken by another that is already helping (it would
    /// drop it). Threads in the team, and the leader, drop theirs.
    fn recruit(self: &Arc<Self>) {
        self.recruited.store(self.start.elapsed().as_nanos() as u64, Relaxed);
        let team = Arc::clone(self);
        rayon::spawn_broadcast(move |_| team.help());
    }

    /// The leader's side of a fork (see the Note).
    fn run(self: &Arc<Self>, tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        // Helpers that left idle are sent for again, at most once per `IDLE`
        // (jobs sent earlier may still be on their way to a busy thread).
        if self.helpers.load(Relaxed) < self.wanted
            && self.start.elapsed().as_nanos() as u64 >= self.recruited.load(Relaxed) + IDLE.as_nanos() as u64
        {
            self.recruit();
        }
        let job = Job { f, tasks, next: AtomicUsize::new(0), panic: Mutex::new(None) };
        // SAFETY: the slot's lifetime is erased; the job outlives every read of
        // it because this function empties the slot and waits for `active` to
        // reach zero before `job` goes out of scope, panics included (tasks'
        // panics are caught by `work`).
        let ptr = unsafe { std::mem::transmute::<*const Job<'_>, *mut Job<'static>>(&job) };
        self.job.store(ptr, SeqCst);
        self.epoch.fetch_add(1, SeqCst);
        ROLE.with(|r| r.set(Role::LeaderInJob));
        job.work();
        ROLE.with(|r| r.set(Role::Leader));
        // Every task is claimed now; helpers still running one are in `active`.
        self.job.store(std::ptr::null_mut(), SeqCst);
        while self.active.load(SeqCst) != 0 {
            std::hint::spin_loop();
        }
        let panic = job.panic.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(p) = panic {
            resume_unwind(p);
        }
    }

    /// A helper's loop: jobs of the team, else rayon's pending work, until
    /// the team stops or nothing came for `IDLE`.
    fn help(self: &Arc<Self>) {
        if ROLE.with(Cell::get) != Role::None || self.stop.load(Acquire) {
            return;
        }
        self.helpers.fetch_add(1, AcqRel);
        ROLE.with(|r| r.set(Role::Helper));
        let _guard = RoleGuard(Role::None);
        // Nothing seen yet: a job posted before this helper came (it was
        // asleep when the fork recruited it) is joined too, else a fork longer
        // than `IDLE` would run on the leader alone, its helper arriving just
        // after the post and leaving idle before the next.
        let mut seen = None;
        let mut idle_since: Option<Instant> = None;
        let mut spins = 0u32;
        while !self.stop.load(Acquire) {
            let epoch = self.epoch.load(Acquire);
            if seen != Some(epoch) {
                seen = Some(epoch);
                self.active.fetch_add(1, SeqCst);
                let ptr = self.job.load(SeqCst);
                if !ptr.is_null() {
                    // SAFETY: `active` was raised before the slot was read, so
                    // the leader keeps the job alive until it drops again.
                    unsafe { &*ptr }.work();
                }
                self.active.fetch_sub(1, SeqCst);
                idle_since = None;
                continue;
            }
            if matches!(rayon::yield_now(), Some(rayon::Yield::Executed)) {
                idle_since = None;
                continue;
            }
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(64) {
                let since = *idle_since.get_or_insert_with(Instant::now);
                if since.elapsed() >= IDLE {
                    break;
                }
            }
        }
        self.helpers.fetch_sub(1, AcqRel);
    }
}

impl Job<'_> {
    /// Claims and runs tasks until none is left; panics are kept for the leader.
    fn work(&self) {
        loop {
            let i = self.next.fetch_add(1, Relaxed);
            if i >= self.tasks {
                return;
            }
            if let Err(p) = catch_unwind(AssertUnwindSafe(|| (self.f)(i))) {
                self.panic.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert(p);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    /// Runs `f` as the leader of a team on a pool of its own (three threads),
    /// so that other tests' teams cannot take its threads.
    fn led<R: Send>(f: impl FnOnce() -> R + Send) -> R {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().expect("a pool");
        pool.install(|| lead(f))
    }

    /// Waits (at most 10 s) until every helper the calling leader recruited is in its loop.
    fn all_helpers_in() {
        let team = LEADING.with(|l| l.borrow().clone()).expect("a leader");
        let start = Instant::now();
        while team.helpers.load(Acquire) < team.wanted {
            assert!(start.elapsed() < Duration::from_secs(10), "the helpers never came");
            // A fork recruits helpers that left (idle) and keeps the others busy.
            fork(2, &|_| ());
        }
    }

    #[test]
    fn a_team_runs_every_task_once() {
        led(|| {
            assert_eq!(ROLE.with(Cell::get), Role::Leader);
            all_helpers_in();
            for tasks in [0, 1, 2, 3, 7, 64, 1000].repeat(10) {
                let hits: Vec<AtomicU32> = (0..tasks).map(|_| AtomicU32::new(0)).collect();
                fork(tasks, &|i| {
                    // A task that forks again runs its parts in place or through rayon.
                    fork(3, &|_| {
                        // Long enough that the helpers take tasks while the leader runs its own.
                        std::hint::black_box((0..2000u32).fold(0u32, |a, b| a.wrapping_mul(31) ^ b));
                        hits[i].fetch_add(1, Relaxed);
                    });
                });
                assert!(hits.iter().all(|h| h.load(Relaxed) == 3), "{tasks} tasks");
            }
        });
    }

    /// A fork that recruits a helper (the first one left idle) posts its job
    /// before the helper wakes: the helper joins that job, not only later ones.
    #[test]
    fn a_helper_joins_the_job_posted_before_it_came() {
        led(|| {
            all_helpers_in();
            // Longer than IDLE without a fork: the helpers go back to the pool.
            let team = LEADING.with(|l| l.borrow().clone()).expect("a leader");
            let start = Instant::now();
            while team.helpers.load(Acquire) > 0 {
                assert!(start.elapsed() < Duration::from_secs(10), "the helpers never left");
                std::thread::sleep(IDLE);
            }
            // And asleep in rayon's pool, as after a pause in a loop.
            std::thread::sleep(Duration::from_millis(20));
            let leader = std::thread::current().id();
            let elsewhere = AtomicU32::new(0);
            // One job of 32 tasks of 10 ms: the leader alone takes 320 ms,
            // time for a woken helper to be scheduled on a busy machine.
            fork(32, &|_| {
                let t = Instant::now();
                while t.elapsed() < Duration::from_millis(10) {
                    std::hint::spin_loop();
                }
                if std::thread::current().id() != leader {
                    elsewhere.fetch_add(1, Relaxed);
                }
            });
            assert!(elsewhere.load(Relaxed) > 0, "the recruited helpers took none of the job's tasks");
        });
    }

    #[test]
    fn a_panicking_task_reaches_the_leader_and_the_team_goes_on() {
        led(|| {
            let ran = AtomicU32::new(0);
            let caught = catch_unwind(AssertUnwindSafe(|| {
                fork(16, &|i| {
                    ran.fetch_add(1, Relaxed);
                    assert_ne!(i, 11, "task 11 fails");
                })
            }));
            assert!(caught.is_err(), "the panic reached the caller");
            assert_eq!(ran.load(Relaxed), 16, "every task ran before the panic was resumed");
            let sum = AtomicU32::new(0);
            fork(8, &|i| {
                sum.fetch_add(i as u32, Relaxed);
            });
            assert_eq!(sum.load(Relaxed), 28);
        });
    }

    #[test]
    fn leaders_on_several_threads_share_the_pool() {
        // Each of four outside threads leads a team on one pool of two threads
        // (a leader's loop may run on another team's helper, which then leads
        // nothing): every fork completes, and a nested `lead` runs in place.
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().expect("a pool");
        std::thread::scope(|s| {
            for t in 0..4u32 {
                let pool = &pool;
                s.spawn(move || {
                    pool.install(|| {
                        lead(|| {
                            for round in 0..200u32 {
                                let sum = AtomicU32::new(0);
                                fork(5, &|i| {
                                    sum.fetch_add(i as u32 + t + round, Relaxed);
                                });
                                assert_eq!(sum.load(Relaxed), 10 + 5 * (t + round));
                            }
                            let role = ROLE.with(Cell::get);
                            lead(|| assert_eq!(ROLE.with(Cell::get), role, "a nested lead runs in place"));
                        })
                    })
                });
            }
        });
        assert!(ROLE.with(Cell::get) == Role::None);
    }
}
