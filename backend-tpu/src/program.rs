//! Programs on a PJRT device (`Backend::compile`): kiln's `Program` lowered
//! to one StableHLO module (`lower::lower_program`), compiled through the
//! compile cache, run on flat buffers with updated parameters donated.
use crate::graph::{data_in, only_the_storage_reaches, PjrtBuffer};
use crate::lower::{lower_program, Constants, LoweredProgram};
use crate::pjrt::{Buffer, Executable};
use kiln_tensor::ir::{Executable as ProgramExecutable, Program, ResultKind};
use kiln_tensor::{Device, Error, Layout, Result, Storage, StorageData, Tensor};
use std::sync::Arc;

/// A program compiled for one PJRT device.
pub(crate) struct PjrtProgram {
    exe: Arc<Executable>,
    program: Program,
    lowered: LoweredProgram,
    /// The buffers of the creation values, passed after the parameters (Note \[Shared constants\]).
    constants: Vec<Arc<Buffer>>,
    device: Device,
}

impl PjrtProgram {
    /// Lowers and compiles `program` for `device`.
    pub(crate) fn new(program: &Program, device: Device) -> Result<PjrtProgram> {
        if !matches!(device, Device::Tpu(_)) {
            return Err(Error::device(
                "compile",
                format!("programs of kiln's representation run on one PJRT device, not {device}"),
            ));
        }
        let lowered = lower_program(program, Constants::Arguments)?;
        let backend = crate::backend()?;
        let exe = backend.executable(&lowered.module)?;
        let constants = lowered
            .constants
            .iter()
            .map(|(bytes, dt)| backend.upload_scalar(bytes, *dt, device))
            .collect::<Result<_>>()?;
        Ok(PjrtProgram { exe, program: program.clone(), lowered, constants, device })
    }
}

impl ProgramExecutable for PjrtProgram {
    fn run(&self, args: &[Tensor]) -> Result<Vec<Tensor>> {
        let (results, checked) = self.run_then_check(args)?;
        checked.map(|()| results)
    }

    fn run_then_check(&self, args: &[Tensor]) -> Result<(Vec<Tensor>, Result<()>)> {
        let backend = crate::backend()?;
        let p = &self.program;
        p.check_args(args, self.device)?;
        let mut updated = vec![false; args.len()];
        for r in p.results() {
            if let ResultKind::Update(k) = r.kind {
                updated[k] = true;
            }
        }
        // Each argument as a whole storage (a view is copied first).
        let flat: Vec<Tensor> = args
            .iter()
            .map(|a| if a.is_whole_storage() { Ok(a.clone()) } else { a.contiguous() })
            .collect::<Result<_>>()?;
        let bufs: Vec<Arc<Buffer>> = flat.iter().map(|a| backend.buffer_of(a)).collect::<Result<_>>()?;
        // An updated argument is donated when only its storage reaches the buffer
        // (the storage and `bufs` hold it) and nothing else reads the storage.
        let non_donatable: Vec<i64> = (0..args.len())
            .filter(|&k| {
                let donate = updated[k]
                    && args[k].is_whole_storage()
                    && Arc::strong_count(&bufs[k]) <= 2
                    && data_in(&args[k].storage().read(), self.device).is_ok_and(|d| only_the_storage_reaches(&d));
                !donate
            })
            .map(|k| k as i64)
            .collect();
        let refs: Vec<&Buffer> = bufs.iter().chain(&self.constants).map(|b| &**b).collect();
        let (mut outs, event) =
            self.exe.execute_with(&refs, self.device.index(), &self.lowered.outputs, &non_donatable)?;
        drop(refs);
        drop(bufs);
        backend.count_execution();
        backend.queue_event("a program", event)?;
        let flags = outs.split_off(p.results().len());
        let mut results = Vec::with_capacity(outs.len());
        for (r, buf) in p.results().iter().zip(outs) {
            let m = p.meta(r.value);
            let data = StorageData::Device(Box::new(PjrtBuffer::Ready(Arc::new(buf))));
            let st = Arc::new(Storage::new(data, m.dtype, m.shape.iter().product(), self.device));
            let value = Tensor::from_storage(st, Layout::contiguous(&m.shape))?;
            results.push(match r.kind {
                ResultKind::Update(k) => {
                    let dst = &args[k];
                    if dst.is_whole_storage() {
                        dst.storage().replace(value.storage().take_data());
                    } else {
                        kiln_tensor::Backend::assign(backend, dst, &value)?;
                    }
                    dst.storage().bump_version();
                    dst.clone()
                }
                ResultKind::Fresh | ResultKind::State | ResultKind::Check(_) => value,
            });
        }
        let checked =
            flags.iter().zip(&self.lowered.checks).try_for_each(|(flag, (c, name))| backend.verify(flag, name, c, &[]));
        Ok((results, checked))
    }
}
