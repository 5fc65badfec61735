//! Compiled programs: `Executable` (a `PJRT_LoadedExecutable`), its
//! serialization, and execution on one device or, for a program partitioned
//! over several devices, on all of them at once.
use super::{err, ffi, Api, Buffer, Client, Event};
use ffi::Args;
use kiln_tensor::{DType, Result};
use std::ptr;
use std::sync::Arc;

/// A compiled, loaded program (`PJRT_LoadedExecutable`), destroyed on drop.
pub struct Executable {
    client: Arc<Client>,
    raw: *mut ffi::PJRT_LoadedExecutable,
    num_outputs: usize,
    /// `addressable_devices`, asked of the plugin once (every launch over a mesh reads it).
    devices: std::sync::OnceLock<Vec<usize>>,
}

// SAFETY: PJRT loaded executables may be executed concurrently from several threads.
unsafe impl Send for Executable {}
// SAFETY: as above.
unsafe impl Sync for Executable {}

impl std::fmt::Debug for Executable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PjrtExecutable({} outputs)", self.num_outputs)
    }
}

impl Executable {
    /// Takes ownership of a loaded executable the plugin just made for `client`
    /// (destroyed on drop) and reads its number of outputs.
    pub(super) fn own(client: &Arc<Client>, raw: *mut ffi::PJRT_LoadedExecutable) -> Result<Executable> {
        let mut exe = Executable { client: client.clone(), raw, num_outputs: 0, devices: Default::default() };
        exe.num_outputs = exe.query_num_outputs()?;
        Ok(exe)
    }

    /// Runs `f` on the executable behind this loaded one (`LoadedExecutable_GetExecutable`),
    /// destroying that handle afterwards whatever `f` returns.
    fn with_executable<R>(&self, f: impl FnOnce(&Api, *mut ffi::PJRT_Executable) -> Result<R>) -> Result<R> {
        let api = &self.client.api;
        let mut g = ffi::PJRT_LoadedExecutable_GetExecutable_Args::new();
        g.loaded_executable = self.raw;
        api.call("LoadedExecutable_GetExecutable", api.t().loaded_executable_get_executable, &mut g)?;
        let r = f(api, g.executable);
        let mut d = ffi::PJRT_Executable_Destroy_Args::new();
        d.executable = g.executable;
        let _ = api.call("Executable_Destroy", api.t().executable_destroy, &mut d);
        r
    }

    fn query_num_outputs(&self) -> Result<usize> {
        self.with_executable(|api, exe| {
            let mut n = ffi::PJRT_Executable_NumOutputs_Args::new();
            n.executable = exe;
            api.call("Executable_NumOutputs", api.t().executable_num_outputs, &mut n)?;
            Ok(n.num_outputs)
        })
    }

    pub fn num_outputs(&self) -> usize {
        self.num_outputs
    }

    /// The executable's serialized form (for the on-disk compile cache).
    pub fn serialize(&self) -> Result<Vec<u8>> {
        self.with_executable(|api, exe| {
            let mut a = ffi::PJRT_Executable_Serialize_Args::new();
            a.executable = exe;
            let r = api.call("Executable_Serialize", api.t().executable_serialize, &mut a);
            let out = r.map(|_| {
                // SAFETY: on success the plugin returned `serialized_bytes_size` bytes, owned by
                // `serialized_executable` until its deleter runs (below, after the copy).
                let bytes =
                    unsafe { std::slice::from_raw_parts(a.serialized_bytes as *const u8, a.serialized_bytes_size) };
                bytes.to_vec()
            });
            if let Some(del) = a.serialized_executable_deleter {
                if !a.serialized_executable.is_null() {
                    // SAFETY: the deleter the plugin gave for exactly this object, called once.
                    unsafe { del(a.serialized_executable) };
                }
            }
            out
        })
    }

    /// Runs the program on device `device` with `args`, returning its output
    /// buffers at once (they fill asynchronously) and the completion event.
    /// `out_meta` gives each output's dtype and dims (known to the caller from
    /// the lowering).
    pub fn execute(
        &self,
        args: &[&Buffer],
        device: usize,
        out_meta: &[(DType, Vec<usize>)],
    ) -> Result<(Vec<Buffer>, Event)> {
        self.execute_with(args, device, out_meta, &[])
    }

    /// [`Executable::execute`], keeping the buffers of the arguments at
    /// `non_donatable` (indices) even where the program donates them.
    pub fn execute_with(
        &self,
        args: &[&Buffer],
        device: usize,
        out_meta: &[(DType, Vec<usize>)],
        non_donatable: &[i64],
    ) -> Result<(Vec<Buffer>, Event)> {
        let device = self.client.device(device)?;
        let (mut bufs, mut events) = self.launch(&[args.to_vec()], Some(device), out_meta, non_donatable, 0)?;
        Ok((bufs.remove(0), events.remove(0)))
    }

    /// The devices one execution runs on, as client device indices, in the
    /// order [`Executable::execute_spmd`] takes its argument lists: the order
    /// `PJRT_LoadedExecutable_AddressableDevices` reports (not necessarily the
    /// device assignment's).
    pub fn addressable_devices(&self) -> Result<Vec<usize>> {
        if let Some(d) = self.devices.get() {
            return Ok(d.clone());
        }
        let d = self.query_addressable_devices()?;
        Ok(self.devices.get_or_init(|| d).clone())
    }

    fn query_addressable_devices(&self) -> Result<Vec<usize>> {
        let api = &self.client.api;
        let mut a = ffi::PJRT_LoadedExecutable_AddressableDevices_Args::new();
        a.executable = self.raw;
        api.call("LoadedExecutable_AddressableDevices", api.t().loaded_executable_addressable_devices, &mut a)?;
        if a.num_addressable_devices > 0 && a.addressable_devices.is_null() {
            return Err(err("the plugin listed no addressable devices of an executable"));
        }
        let raw = if a.num_addressable_devices == 0 {
            &[][..]
        } else {
            // SAFETY: the plugin returned `num_addressable_devices` device pointers owned by the executable.
            unsafe { std::slice::from_raw_parts(a.addressable_devices, a.num_addressable_devices) }
        };
        raw.iter()
            .map(|d| {
                self.client
                    .devices
                    .iter()
                    .position(|c| c == d)
                    .ok_or_else(|| err("an executable's device is not one of the client's addressable devices"))
            })
            .collect()
    }

    /// Runs a program compiled for several devices (an SPMD program over a
    /// mesh) on all of them: `args[i]` are the arguments on the i-th device of
    /// [`Executable::addressable_devices`] (each buffer already on that device),
    /// and every device's outputs have the types `out_meta` (the per-device
    /// shard shapes). Returns each device's outputs and completion event.
    /// `launch_id` must be the same non-zero value in every process (or call)
    /// taking part in one multi-controller launch; 0 for one call over all devices.
    pub fn execute_spmd(
        &self,
        args: &[Vec<&Buffer>],
        out_meta: &[(DType, Vec<usize>)],
        non_donatable: &[i64],
        launch_id: i32,
    ) -> Result<(Vec<Vec<Buffer>>, Vec<Event>)> {
        // A program with collectives launched on fewer devices than it was
        // compiled for waits forever for the missing ones: refuse it here.
        let devices = self.addressable_devices()?;
        if args.len() != devices.len() {
            return Err(err(format!(
                "execute: the program runs on {} devices ({devices:?}), {} argument lists were given",
                devices.len(),
                args.len()
            )));
        }
        if let Some(a) = args.iter().find(|a| a.len() != args[0].len()) {
            return Err(err(format!(
                "execute: every device needs the same number of arguments ({} and {})",
                args[0].len(),
                a.len()
            )));
        }
        // Two programs with collectives in flight at once (launched from two
        // threads) can deadlock: queued in different orders on different devices,
        // or each holding some of the plugin's threads while its collective waits
        // for participants that cannot start (seen on XLA:CPU: "Expected 8 threads
        // to join the rendezvous", then the plugin aborts the process). So one
        // program over several devices runs at a time: a launch waits until the
        // previous one's outputs are computed (its own errors surface to its owner).
        static IN_FLIGHT: std::sync::Mutex<Vec<Event>> = std::sync::Mutex::new(Vec::new());
        let mut previous = IN_FLIGHT.lock().unwrap_or_else(|e| e.into_inner());
        for e in previous.drain(..) {
            // Its own failure surfaces to its owner; a hang is this launch's error too.
            match e.wait_within("the previous program over several devices", super::collective_timeout()) {
                Err(x) if x.to_string().contains("did not complete within") => return Err(x),
                _ => {}
            }
        }
        let (outs, events) = self.launch(args, None, out_meta, non_donatable, launch_id)?;
        for o in &outs {
            match o.first() {
                Some(b) => previous.push(b.ready_event()?),
                None => {
                    // No output to watch: wait for this launch before letting another start.
                    for e in &events {
                        e.wait_within("a program over several devices", super::collective_timeout())?;
                    }
                    break;
                }
            }
        }
        Ok((outs, events))
    }

    /// Runs one device's part of a program compiled for several devices (the
    /// multi-controller pattern: every device, or every process, makes its own
    /// call). `device` is a client device index among
    /// [`Executable::addressable_devices`]; every call of one launch must pass
    /// the same non-zero `launch_id` (see [`launch_id`]), which is how the
    /// devices' collectives find each other. Returns the device's outputs and
    /// completion event; the call returns before the program finishes, which
    /// only happens once every device's part has been launched.
    pub fn execute_sharded(
        &self,
        device: usize,
        args: &[&Buffer],
        out_meta: &[(DType, Vec<usize>)],
        launch_id: i32,
    ) -> Result<(Vec<Buffer>, Event)> {
        let devices = self.addressable_devices()?;
        if !devices.contains(&device) {
            return Err(err(format!(
                "execute_sharded: device {device} is not one of the program's devices {devices:?}"
            )));
        }
        if launch_id == 0 && devices.len() > 1 {
            return Err(err(
                "execute_sharded: a launch over several devices needs a non-zero launch id shared by every call (with 0 the devices wait for each other forever)",
            ));
        }
        let d = self.client.device(device)?;
        let (mut bufs, mut events) = self.launch(&[args.to_vec()], Some(d), out_meta, &[], launch_id)?;
        Ok((bufs.remove(0), events.remove(0)))
    }

    /// `PJRT_LoadedExecutable_Execute` over `args.len()` devices (or on
    /// `device` for a portable program).
    fn launch(
        &self,
        args: &[Vec<&Buffer>],
        device: Option<*mut ffi::PJRT_Device>,
        out_meta: &[(DType, Vec<usize>)],
        non_donatable: &[i64],
        launch_id: i32,
    ) -> Result<(Vec<Vec<Buffer>>, Vec<Event>)> {
        if out_meta.len() != self.num_outputs {
            return Err(err(format!(
                "execute: the program has {} outputs, {} were described",
                self.num_outputs,
                out_meta.len()
            )));
        }
        let n = args.len();
        let api = &self.client.api;
        let arg_ptrs: Vec<Vec<*mut ffi::PJRT_Buffer>> =
            args.iter().map(|a| a.iter().map(|b| b.raw).collect()).collect();
        let arg_lists: Vec<*const *mut ffi::PJRT_Buffer> = arg_ptrs.iter().map(|a| a.as_ptr()).collect();
        let mut outs: Vec<Vec<*mut ffi::PJRT_Buffer>> = vec![vec![ptr::null_mut(); self.num_outputs]; n];
        let out_lists: Vec<*mut *mut ffi::PJRT_Buffer> = outs.iter_mut().map(|o| o.as_mut_ptr()).collect();
        let mut events: Vec<*mut ffi::PJRT_Event> = vec![ptr::null_mut(); n];
        let mut opts = ffi::PJRT_ExecuteOptions::new();
        opts.non_donatable_input_indices = non_donatable.as_ptr();
        opts.num_non_donatable_input_indices = non_donatable.len();
        opts.launch_id = launch_id;
        let mut a = ffi::PJRT_LoadedExecutable_Execute_Args::new();
        a.executable = self.raw;
        a.options = &mut opts;
        a.argument_lists = arg_lists.as_ptr();
        a.num_devices = n;
        a.num_args = args.first().map_or(0, |a| a.len());
        a.output_lists = out_lists.as_ptr();
        a.device_complete_events = events.as_mut_ptr();
        a.execute_device = device.unwrap_or(ptr::null_mut());
        api.call("LoadedExecutable_Execute", api.t().loaded_executable_execute, &mut a)?;
        // Own whatever the plugin returned (so it is freed), then check that it returned everything.
        let missing = outs.iter().flatten().any(|b| b.is_null()) || events.iter().any(|e| e.is_null());
        let bufs: Vec<Vec<Buffer>> = outs
            .into_iter()
            .map(|o| {
                o.into_iter()
                    .zip(out_meta)
                    .filter(|(raw, _)| !raw.is_null())
                    .map(|(raw, (dtype, dims))| Buffer {
                        client: self.client.clone(),
                        raw,
                        dtype: *dtype,
                        dims: dims.clone(),
                    })
                    .collect()
            })
            .collect();
        let events: Vec<Event> =
            events.into_iter().filter(|e| !e.is_null()).map(|raw| Event { api: api.clone(), raw }).collect();
        if missing {
            return Err(err("execute: the plugin returned no output buffer or completion event"));
        }
        Ok((bufs, events))
    }
}

impl Drop for Executable {
    fn drop(&mut self) {
        let mut a = ffi::PJRT_LoadedExecutable_Destroy_Args::new();
        a.executable = self.raw;
        let _ = self.client.api.call("LoadedExecutable_Destroy", self.client.api.t().loaded_executable_destroy, &mut a);
    }
}

/// The launch id of the `n`-th launch of the program `fingerprint` (its text
/// or any bytes every process derives alike): the same in every process, and
/// never 0 (JAX derives its launch ids the same way).
pub fn launch_id(fingerprint: &[u8], n: u64) -> i32 {
    // FNV-1a over the fingerprint and the count.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in fingerprint.iter().chain(&n.to_le_bytes()) {
        h ^= *b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    let id = ((h >> 33) ^ h) as i32 & i32::MAX;
    if id == 0 {
        1
    } else {
        id
    }
}
