//! A small key-value store over TCP (PyTorch's `TCPStore` role): the rendezvous
//! of a process group. Rank 0 serves it; every process (rank 0 included)
//! talks to it as a client. Values are bytes; `get` blocks until the key
//! exists or its deadline passes, `try_get` answers at once, `put` overwrites,
//! `take` is a `get` that removes the key (a message to one receiver).
//! The PJRT plugins that need one (GPU, TPU) read and write it through
//! `PJRT_Client_Create`'s callbacks to exchange topology and communicator ids
//! (see `process_group.rs`).
//!
//! ```no_run
//! use kiln_tpu::store::TcpStore;
//! use std::time::Duration;
//! let server = TcpStore::serve("127.0.0.1:0".parse().unwrap())?;
//! let store = TcpStore::connect(server.addr(), Duration::from_secs(5))?;
//! store.put("rank/0", b"ready")?;
//! assert_eq!(store.get("rank/0", Duration::from_secs(1))?, b"ready");
//! # Ok::<(), kiln_tensor::Error>(())
//! ```
use kiln_tensor::{Error, Result};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

// The wire format, one request then one response on a connection, repeated:
//   request  = op (u8) | key length (u32 LE) | key | op payload
//              PUT: value length (u64 LE) | value;  GET, TAKE: timeout in ms (u64 LE);  TRY_GET: nothing
//   response = status (u8) | length (u64 LE) | bytes (the value, or an error message)
const PUT: u8 = 1;
const GET: u8 = 2;
const TRY_GET: u8 = 3;
const TAKE: u8 = 4;
const OK: u8 = 0;
const NOT_FOUND: u8 = 1;
const DEADLINE: u8 = 2;
const BAD_REQUEST: u8 = 3;
/// The longest key accepted.
pub const MAX_KEY_BYTES: usize = 64 << 10;
/// The largest value accepted.
pub const MAX_VALUE_BYTES: usize = 1 << 30;
/// How much longer than a `get`'s own timeout a client waits for the server's answer.
const REPLY_MARGIN: Duration = Duration::from_secs(5);

/// `timeout` from now, or `None` when that is past what an `Instant` can hold
/// (an unbounded wait, as `Duration::MAX` asks).
pub(crate) fn deadline_after(timeout: Duration) -> Option<Instant> {
    Instant::now().checked_add(timeout)
}

fn store_err(msg: impl std::fmt::Display) -> Error {
    Error::invalid("TcpStore", msg.to_string())
}

type Table = (Mutex<HashMap<Vec<u8>, Arc<Vec<u8>>>>, Condvar);

/// The server side: a listening socket and one thread per connection, until dropped.
pub struct StoreServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    accept: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for StoreServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "StoreServer({})", self.addr)
    }
}

impl StoreServer {
    /// The address clients connect to (the bound port when 0 was asked for).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
    }
}

/// A client of a [`StoreServer`]: thread-safe; each call uses a connection of
/// its own from a small pool, so a blocked `get` never holds up a `put`.
pub struct TcpStore {
    addr: SocketAddr,
    idle: Mutex<Vec<TcpStream>>,
}

impl std::fmt::Debug for TcpStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TcpStore({})", self.addr)
    }
}

impl TcpStore {
    /// Starts a server on `addr` (port 0: any free port), serving until dropped.
    pub fn serve(addr: SocketAddr) -> Result<StoreServer> {
        let listener = TcpListener::bind(addr).map_err(|e| store_err(format!("cannot listen on {addr}: {e}")))?;
        let addr = listener.local_addr().map_err(store_err)?;
        // Non-blocking accepts, polled, so that dropping the server stops the thread.
        listener.set_nonblocking(true).map_err(store_err)?;
        let stop = Arc::new(AtomicBool::new(false));
        let table: Arc<Table> = Arc::new((Mutex::new(HashMap::new()), Condvar::new()));
        let s = stop.clone();
        let accept = std::thread::Builder::new()
            .name("kiln-store".into())
            .spawn(move || {
                while !s.load(Ordering::Relaxed) {
                    match listener.accept() {
                        Ok((conn, _)) => {
                            let t = table.clone();
                            let _ = std::thread::Builder::new()
                                .name("kiln-store-conn".into())
                                .spawn(move || serve_connection(conn, &t));
                        }
                        // Nothing to accept yet (or a failed accept): poll again.
                        Err(_) => std::thread::sleep(Duration::from_millis(5)),
                    }
                }
            })
            .map_err(|e| store_err(format!("cannot start the server thread: {e}")))?;
        Ok(StoreServer { addr, stop, accept: Some(accept) })
    }

    /// Connects to the server at `addr`, retrying until `timeout` (the server
    /// may start after its clients).
    pub fn connect(addr: SocketAddr, timeout: Duration) -> Result<TcpStore> {
        let deadline = deadline_after(timeout);
        loop {
            match TcpStream::connect_timeout(&addr, Duration::from_millis(500)) {
                Ok(c) => return Ok(TcpStore { addr, idle: Mutex::new(vec![c]) }),
                Err(e) if deadline.is_some_and(|d| Instant::now() >= d) => {
                    return Err(store_err(format!("cannot reach the store at {addr} within {timeout:?}: {e}")))
                }
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        }
    }

    /// The server's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Sets `key` to `value` (overwriting), and wakes the `get`s waiting for it.
    pub fn put(&self, key: &str, value: &[u8]) -> Result<()> {
        if value.len() > MAX_VALUE_BYTES {
            return Err(store_err(format!("the value of {key:?} has {} bytes, over {MAX_VALUE_BYTES}", value.len())));
        }
        let mut payload = (value.len() as u64).to_le_bytes().to_vec();
        payload.extend_from_slice(value);
        self.call(PUT, key, &payload, None).map(|_| ())
    }

    /// The value of `key`, waiting up to `timeout` for another process to put it.
    pub fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.wait_for(key, timeout)?
            .ok_or_else(|| store_err(format!("no value for {key:?} in the store at {} after {timeout:?}", self.addr)))
    }

    /// [`TcpStore::get`], with `None` when the deadline passed.
    pub fn wait_for(&self, key: &str, timeout: Duration) -> Result<Option<Vec<u8>>> {
        let ms = timeout.as_millis().min(u64::MAX as u128) as u64;
        self.call(GET, key, &ms.to_le_bytes(), Some(timeout))
    }

    /// [`TcpStore::get`] that also removes `key`: the value goes to one
    /// taker, and the store does not keep it.
    pub fn take(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let ms = timeout.as_millis().min(u64::MAX as u128) as u64;
        self.call(TAKE, key, &ms.to_le_bytes(), Some(timeout))?
            .ok_or_else(|| store_err(format!("no value for {key:?} in the store at {} after {timeout:?}", self.addr)))
    }

    /// The value of `key` if it is set now.
    pub fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        self.call(TRY_GET, key, &[], None)
    }

    /// Sends one request and reads its answer (`None`: no such key, or the
    /// deadline passed) on a pooled connection. A connection that failed is
    /// dropped; one fresh connection is tried once.
    fn call(&self, op: u8, key: &str, payload: &[u8], wait: Option<Duration>) -> Result<Option<Vec<u8>>> {
        if key.len() > MAX_KEY_BYTES {
            return Err(store_err(format!("a key of {} bytes, over {MAX_KEY_BYTES}", key.len())));
        }
        let mut req = vec![op];
        req.extend_from_slice(&(key.len() as u32).to_le_bytes());
        req.extend_from_slice(key.as_bytes());
        req.extend_from_slice(payload);
        let pooled = self.idle.lock().unwrap_or_else(|e| e.into_inner()).pop();
        let mut last = None;
        for conn in [pooled, None] {
            let mut conn = match conn {
                Some(c) => c,
                None => TcpStream::connect_timeout(&self.addr, Duration::from_secs(5))
                    .map_err(|e| store_err(format!("cannot reach the store at {}: {e}", self.addr)))?,
            };
            // A bounded wait for the answer: a dead server is an error, never a hang.
            let _ = conn.set_read_timeout(wait.unwrap_or(Duration::ZERO).checked_add(REPLY_MARGIN));
            match exchange(&mut conn, &req) {
                Ok((status, body)) => {
                    self.idle.lock().unwrap_or_else(|e| e.into_inner()).push(conn);
                    return match status {
                        OK => Ok(Some(body)),
                        NOT_FOUND | DEADLINE => Ok(None),
                        _ => {
                            Err(store_err(format!("the store refused the request: {}", String::from_utf8_lossy(&body))))
                        }
                    };
                }
                Err(e) => last = Some(e),
            }
        }
        Err(store_err(format!("lost the store at {}: {}", self.addr, last.map(|e| e.to_string()).unwrap_or_default())))
    }
}

/// Writes a request and reads the response.
fn exchange(conn: &mut TcpStream, req: &[u8]) -> std::io::Result<(u8, Vec<u8>)> {
    conn.write_all(req)?;
    let mut head = [0u8; 9];
    conn.read_exact(&mut head)?;
    let len = u64::from_le_bytes(head[1..9].try_into().expect("8 bytes")) as usize;
    if len > MAX_VALUE_BYTES {
        return Err(std::io::Error::other(format!("an answer of {len} bytes")));
    }
    let mut body = vec![0u8; len];
    conn.read_exact(&mut body)?;
    Ok((head[0], body))
}

fn read_u32(c: &mut TcpStream) -> std::io::Result<u32> {
    let mut b = [0u8; 4];
    c.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

fn read_u64(c: &mut TcpStream) -> std::io::Result<u64> {
    let mut b = [0u8; 8];
    c.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

fn reply(c: &mut TcpStream, status: u8, body: &[u8]) -> std::io::Result<()> {
    let mut out = vec![status];
    out.extend_from_slice(&(body.len() as u64).to_le_bytes());
    out.extend_from_slice(body);
    c.write_all(&out)
}

/// Answers one client's requests until it disconnects or sends a malformed one.
fn serve_connection(mut c: TcpStream, table: &Table) {
    let _ = c.set_nonblocking(false);
    let _ = c.set_nodelay(true);
    let (map, changed) = table;
    let mut op = [0u8; 1];
    while c.read_exact(&mut op).is_ok() {
        let Ok(klen) = read_u32(&mut c) else { return };
        if klen as usize > MAX_KEY_BYTES {
            let _ = reply(&mut c, BAD_REQUEST, format!("a key of {klen} bytes").as_bytes());
            return;
        }
        let mut key = vec![0u8; klen as usize];
        if c.read_exact(&mut key).is_err() {
            return;
        }
        let answered = match op[0] {
            PUT => {
                let Ok(n) = read_u64(&mut c) else { return };
                if n as usize > MAX_VALUE_BYTES {
                    let _ = reply(&mut c, BAD_REQUEST, format!("a value of {n} bytes").as_bytes());
                    return;
                }
                let mut v = vec![0u8; n as usize];
                if c.read_exact(&mut v).is_err() {
                    return;
                }
                map.lock().unwrap_or_else(|e| e.into_inner()).insert(key, Arc::new(v));
                changed.notify_all();
                reply(&mut c, OK, &[])
            }
            GET | TAKE => {
                let Ok(ms) = read_u64(&mut c) else { return };
                let deadline = deadline_after(Duration::from_millis(ms));
                let mut m = map.lock().unwrap_or_else(|e| e.into_inner());
                let found = loop {
                    let v = if op[0] == TAKE { m.remove(&key) } else { m.get(&key).cloned() };
                    if let Some(v) = v {
                        break Some(v);
                    }
                    m = match deadline {
                        None => changed.wait(m).unwrap_or_else(|e| e.into_inner()),
                        Some(d) => {
                            let now = Instant::now();
                            if now >= d {
                                break None;
                            }
                            changed.wait_timeout(m, d - now).unwrap_or_else(|e| e.into_inner()).0
                        }
                    };
                };
                drop(m);
                match found {
                    Some(v) => reply(&mut c, OK, &v),
                    None => reply(&mut c, DEADLINE, &[]),
                }
            }
            TRY_GET => {
                let v = map.lock().unwrap_or_else(|e| e.into_inner()).get(&key).cloned();
                match v {
                    Some(v) => reply(&mut c, OK, &v),
                    None => reply(&mut c, NOT_FOUND, &[]),
                }
            }
            other => {
                let _ = reply(&mut c, BAD_REQUEST, format!("unknown request {other}").as_bytes());
                return;
            }
        };
        if answered.is_err() {
            return;
        }
    }
}
