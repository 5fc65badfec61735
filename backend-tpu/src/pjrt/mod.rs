//! kiln's own thin PJRT bindings: the plugin opened at run time with
//! `libloading`, its API version checked, and safe owning wrappers for the
//! client, devices, buffers, events and executables.
//!
//! Every call goes through `Api::call`, which turns a returned `PJRT_Error`
//! into a [`kiln_tensor::Error::Backend`] carrying the plugin's message and code.
mod executable;
pub mod ffi;
pub mod kv;
mod options;

pub use executable::{launch_id, Executable};
pub use options::CompileOptions;

use ffi::Args;
use kiln_tensor::{DType, Error, Result};
use std::ffi::c_void;
use std::path::{Path, PathBuf};
use std::ptr;
use std::sync::Arc;

/// The oldest C API minor version whose struct layouts kiln declares (major 0).
pub const MIN_API_MINOR: i32 = 81;

fn err(msg: impl Into<String>) -> Error {
    Error::backend("pjrt", msg)
}

/// A loaded plugin: its function table, kept alive with the library.
pub struct Api {
    table: *const ffi::PJRT_Api,
    path: PathBuf,
    version: (i32, i32),
    _lib: libloading::Library,
}

// SAFETY: the PJRT C API is thread-safe by contract (the header: "the API is
// thread-safe unless stated otherwise"); `table` points at the plugin's static,
// immutable function table, alive as long as `_lib`.
unsafe impl Send for Api {}
// SAFETY: as above; `Api` has no interior mutability of its own.
unsafe impl Sync for Api {}

impl std::fmt::Debug for Api {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PjrtPlugin({}, API {}.{})", self.path.display(), self.version.0, self.version.1)
    }
}

/// How to get a plugin, appended to every "not found" error.
pub const PLUGIN_HINT: &str = "run `scripts/fetch-pjrt-plugin` from the kiln repository (it downloads the XLA:CPU plugin into the cache directory kiln searches), or set KILN_PJRT_PLUGIN to the path of a PJRT plugin (.so), e.g. libtpu.so or xla_cuda_plugin.so";

/// The directory `scripts/fetch-pjrt-plugin` unpacks into: `KILN_PJRT_CACHE`, else
/// `$XDG_CACHE_HOME/kiln/pjrt`, else `~/.cache/kiln/pjrt`.
pub fn plugin_cache_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("KILN_PJRT_CACHE") {
        return Some(PathBuf::from(d));
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("kiln").join("pjrt"))
}

/// The plugin kiln uses: `KILN_PJRT_PLUGIN`, else the XLA:CPU plugin in the cache
/// directory (the newest version there), else an error saying how to get one.
pub fn find_plugin() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("KILN_PJRT_PLUGIN") {
        let p = PathBuf::from(p);
        if !p.is_file() {
            return Err(err(format!("KILN_PJRT_PLUGIN={} is not a file; {PLUGIN_HINT}", p.display())));
        }
        return Ok(p);
    }
    let dir =
        plugin_cache_dir().ok_or_else(|| err(format!("no home directory to search for a plugin; {PLUGIN_HINT}")))?;
    let mut found: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .map(|e| e.path().join("pjrt_c_api_cpu_plugin.so"))
                .filter(|p| p.is_file())
                .collect()
        })
        .unwrap_or_default();
    found.sort();
    found.pop().ok_or_else(|| {
        err(format!(
            "no PJRT plugin found (KILN_PJRT_PLUGIN is not set and {} holds none); {PLUGIN_HINT}",
            dir.display()
        ))
    })
}

impl Api {
    /// Opens a plugin, checks its API version and initialises it.
    pub fn load(path: &Path) -> Result<Arc<Api>> {
        // SAFETY: loading a shared library runs its initialisers; a PJRT plugin is a
        // self-contained library whose initialisers only set up its own state. The
        // path is the user's choice of plugin (KILN_PJRT_PLUGIN or the fetched one).
        let lib = unsafe { libloading::Library::new(path) }
            .map_err(|e| err(format!("cannot load the PJRT plugin {}: {e}; {PLUGIN_HINT}", path.display())))?;
        // SAFETY: `GetPjrtApi` is the one entry point every PJRT plugin exports, with
        // the signature `const PJRT_Api* GetPjrtApi(void)`.
        let get: libloading::Symbol<'_, unsafe extern "C" fn() -> *const ffi::PJRT_Api> =
            unsafe { lib.get(b"GetPjrtApi\0") }
                .map_err(|e| err(format!("{} is not a PJRT plugin (no GetPjrtApi symbol: {e})", path.display())))?;
        // SAFETY: calling the plugin's entry point as declared above; it returns a
        // pointer to a static table (or null on failure, checked next).
        let table = unsafe { get() };
        if table.is_null() {
            return Err(err(format!("the PJRT plugin {} returned no API table", path.display())));
        }
        // SAFETY: `table` is non-null and points at the plugin's table, whose first
        // fields (struct_size, extension_start, pjrt_api_version) exist in every version.
        let (size, major, minor) = unsafe {
            let t = &*table;
            (t.struct_size, t.pjrt_api_version.major_version, t.pjrt_api_version.minor_version)
        };
        if major != 0 || minor < MIN_API_MINOR || size < ffi::API_TABLE_NEEDED {
            return Err(err(format!(
                "the PJRT plugin {} has C API version {major}.{minor} (function table of {size} bytes); kiln needs 0.{MIN_API_MINOR} or newer with the same major version; use a newer plugin ({PLUGIN_HINT})",
                path.display()
            )));
        }
        let api = Api { table, path: path.to_path_buf(), version: (major, minor), _lib: lib };
        let mut a = ffi::PJRT_Plugin_Initialize_Args::new();
        api.call("Plugin_Initialize", api.t().plugin_initialize, &mut a)?;
        Ok(Arc::new(api))
    }

    fn t(&self) -> &ffi::PJRT_Api {
        // SAFETY: checked non-null and long enough in `load`; the table is static in
        // the plugin, which `_lib` keeps loaded.
        unsafe { &*self.table }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The plugin's C API version `(major, minor)`.
    pub fn version(&self) -> (i32, i32) {
        self.version
    }

    /// Calls one API entry with its argument struct; a returned error becomes `Err`.
    fn call<A: Args>(&self, name: &str, f: ffi::ApiFn, args: &mut A) -> Result<()> {
        let f = f.ok_or_else(|| err(format!("the PJRT plugin does not implement {name}")))?;
        // SAFETY: `f` is the plugin's implementation of `name`, and `args` is the
        // `#[repr(C)]` argument struct that entry takes (the caller pairs them), with
        // `struct_size` set and every input pointer valid for the call.
        let e = unsafe { f(args as *mut A as *mut c_void) };
        match self.take_error(e) {
            None => Ok(()),
            Some((msg, code)) => Err(err(format!("{name} failed: {msg} (PJRT error code {code})"))),
        }
    }

    /// Reads and destroys an error returned by the plugin.
    fn take_error(&self, e: *mut ffi::PJRT_Error) -> Option<(String, i32)> {
        if e.is_null() {
            return None;
        }
        let mut m = ffi::PJRT_Error_Message_Args::new();
        m.error = e;
        let mut c = ffi::PJRT_Error_GetCode_Args::new();
        c.error = e;
        let mut d = ffi::PJRT_Error_Destroy_Args::new();
        d.error = e;
        // SAFETY: `e` is a live error the plugin just returned; Message and GetCode
        // only read it, the message is copied before Destroy frees it, and it is
        // destroyed exactly once.
        unsafe {
            let t = self.t();
            let mut msg = String::from("unknown error");
            if let Some(f) = t.error_message {
                f(&mut m as *mut _ as *mut c_void);
                if !m.message.is_null() {
                    let bytes = std::slice::from_raw_parts(m.message as *const u8, m.message_size);
                    msg = String::from_utf8_lossy(bytes).into_owned();
                }
            }
            let mut code = -1;
            if let Some(f) = t.error_get_code {
                if f(&mut c as *mut _ as *mut c_void).is_null() {
                    code = c.code;
                }
            }
            if let Some(f) = t.error_destroy {
                f(&mut d as *mut _ as *mut c_void);
            }
            Some((msg, code))
        }
    }
}

/// A client-creation option (`PJRT_NamedValue`).
#[derive(Debug, Clone)]
pub enum OptionValue {
    Int(i64),
    Bool(bool),
    Str(String),
}

/// A PJRT client and its addressable devices.
pub struct Client {
    api: Arc<Api>,
    raw: *mut ffi::PJRT_Client,
    devices: Vec<*mut ffi::PJRT_Device>,
    platform: String,
    platform_version: String,
}

// SAFETY: PJRT clients are thread-safe (all of PjRtClient's methods may be called
// concurrently); the device pointers are owned by the client and immutable.
unsafe impl Send for Client {}
// SAFETY: as above.
unsafe impl Sync for Client {}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PjrtClient({} {}, {} devices)", self.platform, self.platform_version, self.devices.len())
    }
}

impl Client {
    /// Creates a client with the given options (e.g. `cpu_device_count` for
    /// XLA:CPU) and, for a process of a multi-process group, the key-value
    /// store the plugin may use (see [`kv`]).
    pub fn new(
        api: Arc<Api>,
        options: &[(&str, OptionValue)],
        store: Option<&'static crate::store::TcpStore>,
    ) -> Result<Client> {
        let strings: Vec<Vec<u8>> = options
            .iter()
            .map(|(_, v)| match v {
                OptionValue::Str(s) => s.as_bytes().to_vec(),
                _ => vec![],
            })
            .collect();
        let named: Vec<ffi::PJRT_NamedValue> = options
            .iter()
            .zip(&strings)
            .map(|((name, v), s)| {
                let mut n = ffi::PJRT_NamedValue::new();
                n.name = name.as_ptr() as *const _;
                n.name_size = name.len();
                match v {
                    OptionValue::Int(i) => {
                        n.kind = ffi::NAMED_VALUE_INT64;
                        n.value.int64_value = *i;
                        n.value_size = 1;
                    }
                    OptionValue::Bool(b) => {
                        n.kind = ffi::NAMED_VALUE_BOOL;
                        n.value.bool_value = *b;
                        n.value_size = 1;
                    }
                    OptionValue::Str(_) => {
                        n.kind = ffi::NAMED_VALUE_STRING;
                        n.value.string_value = s.as_ptr() as *const _;
                        n.value_size = s.len();
                    }
                }
                n
            })
            .collect();
        let mut a = ffi::PJRT_Client_Create_Args::new();
        a.create_options = named.as_ptr();
        a.num_options = named.len();
        if let Some(store) = store {
            kv::install(&mut a, store);
        }
        api.call("Client_Create", api.t().client_create, &mut a)?;
        let raw = a.client;
        let mut client = Client { api, raw, devices: vec![], platform: String::new(), platform_version: String::new() };
        let mut d = ffi::PJRT_Client_Devices_Args::new();
        d.client = raw;
        client.api.call("Client_AddressableDevices", client.api.t().client_addressable_devices, &mut d)?;
        // SAFETY: the plugin returned an array of `num_devices` device pointers owned by the client.
        client.devices = unsafe { std::slice::from_raw_parts(d.devices, d.num_devices) }.to_vec();
        client.platform = client.string("Client_PlatformName", client.api.t().client_platform_name)?;
        client.platform_version = client.string("Client_PlatformVersion", client.api.t().client_platform_version)?;
        Ok(client)
    }

    fn string(&self, name: &str, f: ffi::ApiFn) -> Result<String> {
        let mut a = ffi::PJRT_Client_String_Args::new();
        a.client = self.raw;
        self.api.call(name, f, &mut a)?;
        if a.value.is_null() {
            return Ok(String::new());
        }
        // SAFETY: the plugin returned `value_size` bytes owned by the client.
        let b = unsafe { std::slice::from_raw_parts(a.value as *const u8, a.value_size) };
        Ok(String::from_utf8_lossy(b).into_owned())
    }

    pub fn api(&self) -> &Arc<Api> {
        &self.api
    }
    /// Number of addressable devices.
    pub fn device_count(&self) -> usize {
        self.devices.len()
    }
    /// The platform name (`cpu`, `cuda`, `tpu`).
    pub fn platform(&self) -> &str {
        &self.platform
    }
    pub fn platform_version(&self) -> &str {
        &self.platform_version
    }

    fn device(&self, i: usize) -> Result<*mut ffi::PJRT_Device> {
        self.devices.get(i).copied().ok_or_else(|| {
            err(format!("device {i} does not exist: the PJRT client has {} device(s)", self.devices.len()))
        })
    }

    /// The description of device `i` (owned by the client).
    fn description(&self, i: usize) -> Result<*mut ffi::PJRT_DeviceDescription> {
        let mut g = ffi::PJRT_Device_GetDescription_Args::new();
        g.device = self.device(i)?;
        self.api.call("Device_GetDescription", self.api.t().device_get_description, &mut g)?;
        Ok(g.device_description)
    }

    /// The global id of device `i` (what device assignments name; on XLA:CPU,
    /// process p's devices start at 2048 p).
    pub fn device_id(&self, i: usize) -> Result<i64> {
        let mut a = ffi::PJRT_DeviceDescription_Id_Args::new();
        a.device_description = self.description(i)?;
        self.api.call("DeviceDescription_Id", self.api.t().device_description_id, &mut a)?;
        Ok(a.id as i64)
    }

    /// The kind of device `i`, as the plugin describes it (e.g. `cpu`, `TPU v5 lite`).
    pub fn device_kind(&self, i: usize) -> Result<String> {
        let mut k = ffi::PJRT_DeviceDescription_Kind_Args::new();
        k.device_description = self.description(i)?;
        self.api.call("DeviceDescription_Kind", self.api.t().device_description_kind, &mut k)?;
        if k.device_kind.is_null() {
            return Ok(String::new());
        }
        // SAFETY: the plugin returned `device_kind_size` bytes owned by the description.
        let b = unsafe { std::slice::from_raw_parts(k.device_kind as *const u8, k.device_kind_size) };
        Ok(String::from_utf8_lossy(b).into_owned())
    }

    /// Copies host bytes (row-major, `dims`, element type `dtype`) into a new buffer on device `i`.
    /// The plugin copies the data before this returns.
    pub fn buffer_from_host(
        self: &Arc<Self>,
        bytes: &[u8],
        dtype: DType,
        dims: &[usize],
        device: usize,
    ) -> Result<Buffer> {
        // SAFETY of the semantics: ImmutableOnlyDuringCall lets the plugin read `bytes` during the call only.
        let (buf, done) = self.upload(bytes, dtype, dims, device, ffi::HOST_BUFFER_IMMUTABLE_ONLY_DURING_CALL)?;
        drop(done);
        Ok(buf)
    }

    /// Starts copying `bytes` into a new buffer on device `i` and returns at once:
    /// the transfer runs while the host goes on. The returned [`Upload`] owns the
    /// bytes until the transfer is done (dropping it waits for that).
    pub fn buffer_from_host_async(
        self: &Arc<Self>,
        bytes: Vec<u8>,
        dtype: DType,
        dims: &[usize],
        device: usize,
    ) -> Result<(Buffer, Upload)> {
        let (buf, done) =
            self.upload(&bytes, dtype, dims, device, ffi::HOST_BUFFER_IMMUTABLE_UNTIL_TRANSFER_COMPLETES)?;
        // The bytes move into the Upload without moving their heap allocation, which
        // is what the plugin reads.
        Ok((buf, Upload { event: done, bytes }))
    }

    fn upload(
        self: &Arc<Self>,
        bytes: &[u8],
        dtype: DType,
        dims: &[usize],
        device: usize,
        semantics: std::ffi::c_int,
    ) -> Result<(Buffer, Option<Event>)> {
        let n: usize = dims.iter().product();
        if n * dtype.size_in_bytes() != bytes.len() {
            return Err(err(format!(
                "buffer_from_host: {} bytes for {n} elements of {dtype} (shape {dims:?})",
                bytes.len()
            )));
        }
        let dims64: Vec<i64> = dims.iter().map(|&d| d as i64).collect();
        let mut a = ffi::PJRT_Client_BufferFromHostBuffer_Args::new();
        a.client = self.raw;
        a.data = if bytes.is_empty() {
            ptr::NonNull::<u64>::dangling().as_ptr() as *const c_void
        } else {
            bytes.as_ptr() as *const c_void
        };
        a.kind = buffer_type(dtype);
        a.dims = dims64.as_ptr();
        a.num_dims = dims64.len();
        a.host_buffer_semantics = semantics;
        a.device = self.device(device)?;
        self.api.call("Client_BufferFromHostBuffer", self.api.t().client_buffer_from_host_buffer, &mut a)?;
        let done =
            (!a.done_with_host_buffer.is_null()).then(|| Event { api: self.api.clone(), raw: a.done_with_host_buffer });
        Ok((Buffer { client: self.clone(), raw: a.buffer, dtype, dims: dims.to_vec() }, done))
    }

    /// Compiles a StableHLO module (MLIR text) for one device, portable across
    /// this client's devices (the device is chosen at execution).
    pub fn compile(self: &Arc<Self>, mlir: &str) -> Result<Executable> {
        self.compile_with(mlir, &CompileOptions::single())
    }

    /// Compiles a StableHLO module with the given options (Note [Compile options]).
    pub fn compile_with(self: &Arc<Self>, mlir: &str, options: &CompileOptions) -> Result<Executable> {
        self.compile_code(mlir.as_bytes(), options).map_err(|e| custom_context(e, mlir))
    }

    /// Compiles a program in the plugin's "mlir" format: MLIR text, or MLIR
    /// bytecode such as a StableHLO portable artifact.
    pub fn compile_code(self: &Arc<Self>, code: &[u8], options: &CompileOptions) -> Result<Executable> {
        let format = b"mlir";
        let mut code = code.to_vec();
        let mut p = ffi::PJRT_Program::new();
        p.code = code.as_mut_ptr() as *mut _;
        p.code_size = code.len();
        p.format = format.as_ptr() as *const _;
        p.format_size = format.len();
        let opts = options.encode();
        let mut a = ffi::PJRT_Client_Compile_Args::new();
        a.client = self.raw;
        a.program = &p;
        a.compile_options = opts.as_ptr() as *const _;
        a.compile_options_size = opts.len();
        self.api.call("Client_Compile", self.api.t().client_compile, &mut a)?;
        Executable::own(self, a.executable)
    }
}

/// A compile error of a program holding custom ops' lowerings (Note [Custom
/// ops]) names them: their text was written outside kiln.
fn custom_context(e: Error, mlir: &str) -> Error {
    const MARK: &str = "func.func private @kiln_custom_";
    let ops: Vec<&str> =
        mlir.match_indices(MARK).filter_map(|(i, _)| mlir[i + MARK.len()..].split('(').next()).collect();
    if ops.is_empty() {
        return e;
    }
    let note = format!(" (the program calls the StableHLO lowerings of custom ops: {})", ops.join(", "));
    match e {
        Error::Backend { backend, msg } => Error::Backend { backend, msg: msg + &note },
        e => e,
    }
}

impl Client {
    /// Loads an executable serialized by [`Executable::serialize`] with this
    /// plugin build; a foreign or corrupt one is an error (never trusted).
    pub fn deserialize(self: &Arc<Self>, bytes: &[u8]) -> Result<Executable> {
        let mut a = ffi::PJRT_Executable_DeserializeAndLoad_Args::new();
        a.client = self.raw;
        a.serialized_executable = bytes.as_ptr() as *const _;
        a.serialized_executable_size = bytes.len();
        self.api.call("Executable_DeserializeAndLoad", self.api.t().executable_deserialize_and_load, &mut a)?;
        Executable::own(self, a.loaded_executable)
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        let mut a = ffi::PJRT_Client_Destroy_Args::new();
        a.client = self.raw;
        // An error while tearing down has nowhere to go; the plugin reports it and frees the client anyway.
        let _ = self.api.call("Client_Destroy", self.api.t().client_destroy, &mut a);
    }
}

/// The PJRT element type of a kiln dtype.
pub fn buffer_type(d: DType) -> std::ffi::c_int {
    match d {
        DType::Bool => ffi::BUFFER_TYPE_PRED,
        DType::U8 => ffi::BUFFER_TYPE_U8,
        DType::I8 => ffi::BUFFER_TYPE_S8,
        DType::I16 => ffi::BUFFER_TYPE_S16,
        DType::I32 => ffi::BUFFER_TYPE_S32,
        DType::I64 => ffi::BUFFER_TYPE_S64,
        DType::F8E5M2 => ffi::BUFFER_TYPE_F8E5M2,
        DType::F8E4M3FN => ffi::BUFFER_TYPE_F8E4M3FN,
        DType::F16 => ffi::BUFFER_TYPE_F16,
        DType::BF16 => ffi::BUFFER_TYPE_BF16,
        DType::F32 => ffi::BUFFER_TYPE_F32,
        DType::F64 => ffi::BUFFER_TYPE_F64,
    }
}

/// A completion event (`PJRT_Event`), destroyed on drop.
pub struct Event {
    api: Arc<Api>,
    raw: *mut ffi::PJRT_Event,
}

// SAFETY: PJRT events may be awaited and destroyed from any thread.
unsafe impl Send for Event {}
// SAFETY: as above; all methods take the plugin's thread-safe paths.
unsafe impl Sync for Event {}

impl Event {
    /// Blocks until the event fires; an asynchronous failure becomes `Err`.
    pub fn wait(&self, what: &str) -> Result<()> {
        let mut a = ffi::PJRT_Event_Args::new();
        a.event = self.raw;
        self.api.call(what, self.api.t().event_await, &mut a)
    }
    /// [`Event::wait`], giving up after `timeout`: for programs over several
    /// devices, whose collectives wait for every device, so that a device that
    /// failed or never started is an error rather than a hang (the program
    /// itself stays stuck in the plugin: XLA cannot cancel a collective).
    pub fn wait_within(&self, what: &str, timeout: std::time::Duration) -> Result<()> {
        let deadline = crate::store::deadline_after(timeout);
        let mut pause = std::time::Duration::from_micros(50);
        while !self.is_ready()? {
            if deadline.is_some_and(|d| std::time::Instant::now() >= d) {
                return Err(err(format!(
                    "{what} did not complete within {timeout:?}: a device of the launch failed or never started, and the others wait for it in their collectives (KILN_COLLECTIVE_TIMEOUT_S sets the wait)"
                )));
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(std::time::Duration::from_millis(20));
        }
        self.wait(what)
    }
    /// Whether the event has fired (without blocking).
    pub fn is_ready(&self) -> Result<bool> {
        let mut a = ffi::PJRT_Event_IsReady_Args::new();
        a.event = self.raw;
        self.api.call("Event_IsReady", self.api.t().event_is_ready, &mut a)?;
        Ok(a.is_ready)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        let mut a = ffi::PJRT_Event_Args::new();
        a.event = self.raw;
        let _ = self.api.call("Event_Destroy", self.api.t().event_destroy, &mut a);
    }
}

/// How long a wait for a program over several devices may last
/// (`KILN_COLLECTIVE_TIMEOUT_S`, default 600 s, PyTorch's collective timeout).
pub fn collective_timeout() -> std::time::Duration {
    static T: std::sync::OnceLock<std::time::Duration> = std::sync::OnceLock::new();
    *T.get_or_init(|| {
        let secs = std::env::var("KILN_COLLECTIVE_TIMEOUT_S").ok().and_then(|v| v.parse::<f64>().ok());
        // NaN, zero, negative or past what a Duration holds: the default.
        secs.filter(|s| *s > 0.0)
            .and_then(|s| std::time::Duration::try_from_secs_f64(s).ok())
            .unwrap_or(std::time::Duration::from_secs(600))
    })
}

/// Host bytes being copied to a device: kept alive until the plugin is done
/// with them. Dropping an `Upload` waits for the transfer.
pub struct Upload {
    event: Option<Event>,
    // Read by the plugin (through the pointer passed at the upload) until `event` fires.
    #[allow(dead_code)]
    bytes: Vec<u8>,
}

impl Upload {
    /// Whether the plugin is done with the bytes (they may then be freed).
    pub fn is_done(&self) -> bool {
        self.event.as_ref().is_none_or(|e| e.is_ready().unwrap_or(true))
    }
    /// Waits for the transfer; its failure becomes `Err`.
    pub fn wait(mut self) -> Result<()> {
        match self.event.take() {
            Some(e) => e.wait("copying host data to a device"),
            None => Ok(()),
        }
    }
}

impl Drop for Upload {
    fn drop(&mut self) {
        if let Some(e) = self.event.take() {
            // The bytes must outlive the transfer; a failure of the transfer itself
            // surfaces when the buffer is read.
            let _ = e.wait("copying host data to a device");
        }
        // `bytes` is freed after this, once the plugin no longer reads it.
    }
}

/// A device buffer (`PJRT_Buffer`), destroyed on drop.
pub struct Buffer {
    client: Arc<Client>,
    raw: *mut ffi::PJRT_Buffer,
    dtype: DType,
    dims: Vec<usize>,
}

// SAFETY: PJRT buffers are immutable device arrays whose methods are thread-safe;
// the handle is owned by this value and destroyed once.
unsafe impl Send for Buffer {}
// SAFETY: as above.
unsafe impl Sync for Buffer {}

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PjrtBuffer({} {:?})", self.dtype, self.dims)
    }
}

impl Buffer {
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    pub fn dims(&self) -> &[usize] {
        &self.dims
    }
    pub fn numel(&self) -> usize {
        self.dims.iter().product()
    }
    /// Copies the buffer into `dst` (row-major), waiting for the copy (and so
    /// for the computation producing the buffer): an asynchronous failure of
    /// that computation surfaces here.
    pub fn copy_to_host(&self, dst: &mut [u8]) -> Result<()> {
        let need = self.numel() * self.dtype.size_in_bytes();
        if dst.len() != need {
            return Err(err(format!("copy_to_host: {} bytes for a buffer of {need}", dst.len())));
        }
        if need == 0 {
            return Ok(());
        }
        let mut a = ffi::PJRT_Buffer_ToHostBuffer_Args::new();
        a.src = self.raw;
        a.dst = dst.as_mut_ptr() as *mut c_void;
        a.dst_size = dst.len();
        self.client.api.call("Buffer_ToHostBuffer", self.client.api.t().buffer_to_host_buffer, &mut a)?;
        if !a.event.is_null() {
            let ev = Event { api: self.client.api.clone(), raw: a.event };
            // `dst` stays borrowed until the copy completes: we wait here.
            ev.wait("reading a device buffer")?;
        }
        Ok(())
    }
    /// A copy of the buffer on device `device` of the same client
    /// (`PJRT_Buffer_CopyToDevice`): device to device, without the host. The
    /// copy is asynchronous; reading the new buffer waits for it.
    pub fn copy_to_device(&self, device: usize) -> Result<Buffer> {
        let mut a = ffi::PJRT_Buffer_CopyToDevice_Args::new();
        a.buffer = self.raw;
        a.dst_device = self.client.device(device)?;
        self.client.api.call("Buffer_CopyToDevice", self.client.api.t().buffer_copy_to_device, &mut a)?;
        Ok(Buffer { client: self.client.clone(), raw: a.dst_buffer, dtype: self.dtype, dims: self.dims.clone() })
    }

    /// An event that fires when the buffer's contents are computed.
    pub fn ready_event(&self) -> Result<Event> {
        let mut a = ffi::PJRT_Buffer_ReadyEvent_Args::new();
        a.buffer = self.raw;
        self.client.api.call("Buffer_ReadyEvent", self.client.api.t().buffer_ready_event, &mut a)?;
        Ok(Event { api: self.client.api.clone(), raw: a.event })
    }

    /// Checks that the plugin holds the buffer as the type it was described
    /// as (`dtype`, `dims`): a program whose results a caller described from
    /// elsewhere (an export's manifest) is checked against what it made.
    pub fn check_described(&self) -> Result<()> {
        let api = &self.client.api;
        let mut t = ffi::PJRT_Buffer_ElementType_Args::new();
        t.buffer = self.raw;
        api.call("Buffer_ElementType", api.t().buffer_element_type, &mut t)?;
        let mut d = ffi::PJRT_Buffer_Dimensions_Args::new();
        d.buffer = self.raw;
        api.call("Buffer_Dimensions", api.t().buffer_dimensions, &mut d)?;
        let dims: &[i64] = if d.num_dims == 0 || d.dims.is_null() {
            &[]
        } else {
            // SAFETY: the plugin returns `num_dims` dimensions owned by the
            // buffer, which `self` keeps alive for this borrow.
            unsafe { std::slice::from_raw_parts(d.dims, d.num_dims) }
        };
        let same_dims = dims.len() == self.dims.len() && dims.iter().zip(&self.dims).all(|(&a, &b)| a == b as i64);
        if t.kind != buffer_type(self.dtype) || !same_dims {
            return Err(err(format!(
                "the program made a buffer of element type {} and dimensions {dims:?}, described as {} {:?}",
                t.kind, self.dtype, self.dims
            )));
        }
        Ok(())
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        let mut a = ffi::PJRT_Buffer_Destroy_Args::new();
        a.buffer = self.raw;
        let _ = self.client.api.call("Buffer_Destroy", self.client.api.t().buffer_destroy, &mut a);
    }
}

/// The plugin's attributes as `name=value` pairs (lists joined by dots:
/// `stablehlo_current_version=1.20.0`), or empty when it has none.
pub fn describe(api: &Api) -> String {
    let mut a = ffi::PJRT_Plugin_Attributes_Args::new();
    if api.call("Plugin_Attributes", api.t().plugin_attributes, &mut a).is_err() || a.attributes.is_null() {
        return String::new();
    }
    // SAFETY: the plugin returned `num_attributes` named values it owns for its lifetime.
    let attrs = unsafe { std::slice::from_raw_parts(a.attributes, a.num_attributes) };
    let mut out = vec![];
    for at in attrs {
        // SAFETY: each name is `name_size` bytes; string values are `value_size` bytes.
        let name = unsafe { std::slice::from_raw_parts(at.name as *const u8, at.name_size) };
        let name = String::from_utf8_lossy(name);
        let value = match at.kind {
            // SAFETY: the union member matches `kind`.
            ffi::NAMED_VALUE_STRING => unsafe {
                String::from_utf8_lossy(std::slice::from_raw_parts(at.value.string_value as *const u8, at.value_size))
                    .into_owned()
            },
            // SAFETY: as above.
            ffi::NAMED_VALUE_INT64 => unsafe { at.value.int64_value.to_string() },
            // SAFETY: as above.
            ffi::NAMED_VALUE_BOOL => unsafe { at.value.bool_value.to_string() },
            // SAFETY: as above; the list holds `value_size` integers.
            ffi::NAMED_VALUE_INT64_LIST => unsafe {
                let v = std::slice::from_raw_parts(at.value.int64_array_value, at.value_size);
                v.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(".")
            },
            _ => continue,
        };
        out.push(format!("{name}={value}"));
    }
    out.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argument_structs_carry_their_size() {
        let a = ffi::PJRT_Client_Compile_Args::new();
        assert_eq!(a.struct_size, std::mem::size_of::<ffi::PJRT_Client_Compile_Args>());
        assert!(a.client.is_null() && a.executable.is_null());
        // The 0.81 layouts: 7 and 14 eight-byte fields.
        assert_eq!(std::mem::size_of::<ffi::PJRT_Client_Compile_Args>(), 56);
        assert_eq!(std::mem::size_of::<ffi::PJRT_ExecuteOptions>(), 14 * 8);
        assert_eq!(std::mem::size_of::<ffi::PJRT_NamedValue>(), 7 * 8);
    }

    #[test]
    fn a_missing_or_foreign_plugin_is_a_clear_error() {
        let e = Api::load(Path::new("/nonexistent/pjrt_plugin.so")).unwrap_err().to_string();
        assert!(e.contains("cannot load the PJRT plugin") && e.contains("fetch-pjrt-plugin"), "{e}");
        // A shared library that is not a PJRT plugin.
        let libc = ["/lib/x86_64-linux-gnu/libc.so.6", "/usr/lib/x86_64-linux-gnu/libc.so.6", "/lib64/libc.so.6"]
            .into_iter()
            .find(|p| Path::new(p).exists());
        if let Some(p) = libc {
            let e = Api::load(Path::new(p)).unwrap_err().to_string();
            assert!(e.contains("is not a PJRT plugin"), "{e}");
        }
    }
}
