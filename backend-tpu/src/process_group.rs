//! Several processes, one PJRT client each (PyTorch's `init_process_group`,
//! JAX's `jax.distributed.initialize`): rank 0 serves a [`TcpStore`], every
//! process joins it, and the PJRT client is created as one node of the group
//! (see Note [Process groups]).
//!
//! ```no_run
//! // In each of WORLD_SIZE processes, with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set:
//! let pg = kiln_tpu::init_process_group(kiln_tpu::ProcessGroupOptions::from_env()?)?;
//! println!("rank {} of {}: devices {:?}", pg.rank(), pg.world_size(), pg.devices_of(pg.rank()));
//! # Ok::<(), kiln_tensor::Error>(())
//! ```
use crate::pjrt::OptionValue;
use crate::store::{StoreServer, TcpStore};
use kiln_tensor::{Error, Result};
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::OnceLock;
use std::time::Duration;

// Note [Process groups]
// ~~~~~~~~~~~~~~~~~~~~~
// kiln drives every device of its PJRT client from one process. Across hosts
// (a TPU pod slice, several GPU hosts) each host runs one process, and the
// processes meet through a key-value store: rank 0 serves a `TcpStore` at
// MASTER_ADDR:MASTER_PORT, every rank announces itself there and waits for
// the others (with a deadline: a rank that never comes is an error naming it,
// not a hang). The PJRT client is then created as one node of the group: the
// GPU and TPU plugins take the create options `node_id` / `num_nodes` and
// exchange their topology (and NCCL ids) through the store, via
// `PJRT_Client_Create`'s key-value callbacks (`pjrt/kv.rs`); the XLA:CPU
// plugin takes `process_id` instead, which numbers its devices from
// 2048 * rank, and never calls the store. Last, every rank publishes the global
// ids of its devices, so each process knows the whole device list a
// multi-process device assignment names.
//
// A program over devices of several processes is compiled by every process
// with the same device assignment and launched by each on its own devices
// with a shared launch id (`Executable::execute_sharded`, the multi-controller
// pattern). The XLA:CPU plugin has no cross-process transport and refuses such
// a program ("Multiprocess computations aren't implemented on the CPU
// backend"): here the store, the bootstrap, the per-device launch and that
// refusal are tested; a program actually spanning processes needs a
// multi-GPU or TPU host.

/// How this process joins a process group.
#[derive(Debug, Clone)]
pub struct ProcessGroupOptions {
    /// This process's rank, `0..world_size`.
    pub rank: usize,
    /// The number of processes.
    pub world_size: usize,
    /// Where rank 0 serves the store.
    pub master: SocketAddr,
    /// How long to wait for the store and for the other ranks.
    pub timeout: Duration,
}

impl ProcessGroupOptions {
    /// PyTorch's environment variables: `RANK`, `WORLD_SIZE`, `MASTER_ADDR`,
    /// `MASTER_PORT`; the wait is `KILN_PG_TIMEOUT_S` seconds (default 300).
    pub fn from_env() -> Result<ProcessGroupOptions> {
        let var = |name: &str| {
            std::env::var(name).map_err(|_| Error::invalid("init_process_group", format!("{name} is not set")))
        };
        let num = |name: &str, v: String| {
            v.parse::<u64>().map_err(|_| Error::invalid("init_process_group", format!("{name}={v:?} is not a number")))
        };
        let rank = num("RANK", var("RANK")?)? as usize;
        let world_size = num("WORLD_SIZE", var("WORLD_SIZE")?)? as usize;
        let host = var("MASTER_ADDR")?;
        let port = num("MASTER_PORT", var("MASTER_PORT")?)?;
        let master = (host.as_str(), port as u16)
            .to_socket_addrs()
            .ok()
            .and_then(|mut a| a.next())
            .ok_or_else(|| Error::invalid("init_process_group", format!("cannot resolve MASTER_ADDR={host:?}")))?;
        let timeout = match std::env::var("KILN_PG_TIMEOUT_S") {
            Ok(v) => Duration::from_secs(num("KILN_PG_TIMEOUT_S", v)?),
            Err(_) => Duration::from_secs(300),
        };
        Ok(ProcessGroupOptions { rank, world_size, master, timeout })
    }
}

/// This process's place in its group, and every rank's devices.
#[derive(Debug)]
pub struct ProcessGroup {
    rank: usize,
    world_size: usize,
    store: &'static TcpStore,
    devices: Vec<Vec<i64>>,
    _server: Option<StoreServer>,
}

impl ProcessGroup {
    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }
    /// The number of processes.
    pub fn world_size(&self) -> usize {
        self.world_size
    }
    /// The group's store (keys under `kiln/` and `pjrt/` are taken).
    pub fn store(&self) -> &'static TcpStore {
        self.store
    }
    /// The global device ids (what device assignments name) of rank `r`'s devices.
    pub fn devices_of(&self, r: usize) -> &[i64] {
        self.devices.get(r).map_or(&[], |d| d.as_slice())
    }
    /// Waits until every rank has reached the barrier named `name` (each name
    /// once). Rank 0, whose process serves the store, leaves last: after every
    /// other rank has stopped reading the barrier's keys, so that it may exit.
    pub fn barrier(&self, name: &str, timeout: Duration) -> Result<()> {
        let wait_all = |phase: &str, ranks: std::ops::Range<usize>| -> Result<()> {
            for r in ranks {
                if self.store.wait_for(&format!("kiln/barrier/{name}/{phase}/{r}"), timeout)?.is_none() {
                    return Err(Error::invalid(
                        "barrier",
                        format!("rank {r} did not reach barrier {name:?} within {timeout:?}"),
                    ));
                }
            }
            Ok(())
        };
        self.store.put(&format!("kiln/barrier/{name}/in/{}", self.rank), b"")?;
        wait_all("in", 0..self.world_size)?;
        if self.rank == 0 {
            return wait_all("out", 1..self.world_size);
        }
        // Every rank has reached the barrier (the "in" keys say so). Rank 0
        // may exit, closing the store, as soon as it reads this key, possibly
        // before the store's reply to this put is sent: a put that fails now
        // has either reached rank 0 or makes rank 0 fail by its timeout, so
        // this rank's barrier has passed either way.
        if let Err(e) = self.store.put(&format!("kiln/barrier/{name}/out/{}", self.rank), b"") {
            tracing::debug!(target: "kiln::pjrt", barrier = name, error = %e, "the store closed after the barrier");
        }
        Ok(())
    }
}

/// What the backend's start needs of a joined group.
pub(crate) struct Joined {
    pub rank: usize,
    pub world_size: usize,
    pub store: &'static TcpStore,
}

/// The create options that make the client one node of the group.
pub(crate) fn client_options(g: &Joined, xla_cpu: bool) -> Vec<(&'static str, OptionValue)> {
    if xla_cpu {
        vec![("process_id", OptionValue::Int(g.rank as i64))]
    } else {
        vec![("node_id", OptionValue::Int(g.rank as i64)), ("num_nodes", OptionValue::Int(g.world_size as i64))]
    }
}

static GROUP: OnceLock<ProcessGroup> = OnceLock::new();

/// The process group this process joined, if any.
pub fn process_group() -> Option<&'static ProcessGroup> {
    GROUP.get()
}

/// Joins the process group (once per process, before the PJRT backend
/// starts): rank 0 serves the store, every rank waits for all the others,
/// the PJRT client is created as node `rank` of `world_size`, and the ranks
/// exchange their devices' global ids (Note [Process groups]).
pub fn init_process_group(opts: ProcessGroupOptions) -> Result<&'static ProcessGroup> {
    let bad = |m: String| Error::invalid("init_process_group", m);
    if GROUP.get().is_some() {
        return Err(bad("this process has already joined a process group".into()));
    }
    if opts.world_size == 0 || opts.rank >= opts.world_size {
        return Err(bad(format!("rank {} of a world of {}", opts.rank, opts.world_size)));
    }
    let server = if opts.rank == 0 { Some(TcpStore::serve(opts.master)?) } else { None };
    let store: &'static TcpStore = Box::leak(Box::new(TcpStore::connect(opts.master, opts.timeout)?));
    // Everyone announces itself with its view of the world size, then waits for the others.
    let me = format!("{} {}", opts.world_size, std::process::id());
    store.put(&format!("kiln/join/{}", opts.rank), me.as_bytes())?;
    for r in 0..opts.world_size {
        let v = store
            .wait_for(&format!("kiln/join/{r}"), opts.timeout)?
            .ok_or_else(|| bad(format!("rank {r} did not join within {:?}", opts.timeout)))?;
        let world = String::from_utf8_lossy(&v).split(' ').next().unwrap_or_default().to_string();
        if world != opts.world_size.to_string() {
            return Err(bad(format!(
                "rank {r} was started with WORLD_SIZE={world}, this one with {}",
                opts.world_size
            )));
        }
    }
    crate::start(Some(&Joined { rank: opts.rank, world_size: opts.world_size, store }), None)?;
    let client = crate::backend()?.client().clone();
    let mine: Vec<i64> = (0..client.device_count()).map(|i| client.device_id(i)).collect::<Result<_>>()?;
    let bytes: Vec<u8> = mine.iter().flat_map(|d| d.to_le_bytes()).collect();
    store.put(&format!("kiln/devices/{}", opts.rank), &bytes)?;
    let mut devices = vec![];
    for r in 0..opts.world_size {
        let v = store
            .wait_for(&format!("kiln/devices/{r}"), opts.timeout)?
            .ok_or_else(|| bad(format!("rank {r} did not publish its devices within {:?}", opts.timeout)))?;
        if v.len() % 8 != 0 {
            return Err(bad(format!("rank {r}'s device list has {} bytes, not a list of int64 ids", v.len())));
        }
        devices.push(v.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes"))).collect());
    }
    let group = ProcessGroup { rank: opts.rank, world_size: opts.world_size, store, devices, _server: server };
    let _ = GROUP.set(group);
    let g = GROUP.get().ok_or_else(|| bad("the group was not recorded".into()))?;
    // Rank 0's store must outlive every rank's bootstrap reads.
    g.barrier("joined", opts.timeout)?;
    Ok(g)
}
