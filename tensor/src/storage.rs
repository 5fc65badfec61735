//! `Storage`: the memory shared by a base tensor and all its views, with the
//! version counter that in-place writes bump; `HostBuffer`: typed host memory.
use crate::float8::{f8e4m3fn, f8e5m2};
use crate::{DType, Device, Element, Error, Result};
use half::{bf16, f16};
use std::any::Any;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// Typed host memory: one `Vec` per dtype.
#[derive(Debug, Clone, PartialEq)]
pub enum HostBuffer {
    Bool(Vec<bool>),
    U8(Vec<u8>),
    I8(Vec<i8>),
    I16(Vec<i16>),
    I32(Vec<i32>),
    I64(Vec<i64>),
    F8E5M2(Vec<f8e5m2>),
    F8E4M3FN(Vec<f8e4m3fn>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
    F32(Vec<f32>),
    F64(Vec<f64>),
}

/// Runs `$body` with `$v` bound to the typed `Vec` inside a `HostBuffer`
/// (and `$T` to its element type, when given).
#[macro_export]
macro_rules! with_host_buffer {
    ($buf:expr, $v:ident => $body:expr) => {
        match $buf {
            $crate::HostBuffer::Bool($v) => $body,
            $crate::HostBuffer::U8($v) => $body,
            $crate::HostBuffer::I8($v) => $body,
            $crate::HostBuffer::I16($v) => $body,
            $crate::HostBuffer::I32($v) => $body,
            $crate::HostBuffer::I64($v) => $body,
            $crate::HostBuffer::F8E5M2($v) => $body,
            $crate::HostBuffer::F8E4M3FN($v) => $body,
            $crate::HostBuffer::F16($v) => $body,
            $crate::HostBuffer::BF16($v) => $body,
            $crate::HostBuffer::F32($v) => $body,
            $crate::HostBuffer::F64($v) => $body,
        }
    };
}

/// Runs `$body` with the type alias `$T` set to the Rust element type of `$dtype`.
#[macro_export]
macro_rules! with_dtype {
    ($dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            $crate::DType::Bool => {
                type $T = bool;
                $body
            }
            $crate::DType::U8 => {
                type $T = u8;
                $body
            }
            $crate::DType::I8 => {
                type $T = i8;
                $body
            }
            $crate::DType::I16 => {
                type $T = i16;
                $body
            }
            $crate::DType::I32 => {
                type $T = i32;
                $body
            }
            $crate::DType::I64 => {
                type $T = i64;
                $body
            }
            $crate::DType::F8E5M2 => {
                type $T = $crate::float8::f8e5m2;
                $body
            }
            $crate::DType::F8E4M3FN => {
                type $T = $crate::float8::f8e4m3fn;
                $body
            }
            $crate::DType::F16 => {
                type $T = $crate::half::f16;
                $body
            }
            $crate::DType::BF16 => {
                type $T = $crate::half::bf16;
                $body
            }
            $crate::DType::F32 => {
                type $T = f32;
                $body
            }
            $crate::DType::F64 => {
                type $T = f64;
                $body
            }
        }
    };
}

/// Conversion between `Vec<T>` / `&[T]` and `HostBuffer` for every element type.
pub trait HostElement: Element {
    fn into_buffer(v: Vec<Self>) -> HostBuffer;
    fn slice(b: &HostBuffer) -> Option<&[Self]>;
    fn slice_mut(b: &mut HostBuffer) -> Option<&mut [Self]>;
    fn vec(b: HostBuffer) -> Option<Vec<Self>>;
}
macro_rules! host_element {
    ($t:ty, $v:ident) => {
        impl HostElement for $t {
            fn into_buffer(v: Vec<Self>) -> HostBuffer {
                HostBuffer::$v(v)
            }
            fn slice(b: &HostBuffer) -> Option<&[Self]> {
                match b {
                    HostBuffer::$v(v) => Some(v),
                    _ => None,
                }
            }
            fn slice_mut(b: &mut HostBuffer) -> Option<&mut [Self]> {
                match b {
                    HostBuffer::$v(v) => Some(v),
                    _ => None,
                }
            }
            fn vec(b: HostBuffer) -> Option<Vec<Self>> {
                match b {
                    HostBuffer::$v(v) => Some(v),
                    _ => None,
                }
            }
        }
    };
}
host_element!(bool, Bool);
host_element!(u8, U8);
host_element!(i8, I8);
host_element!(i16, I16);
host_element!(i32, I32);
host_element!(i64, I64);
host_element!(f8e5m2, F8E5M2);
host_element!(f8e4m3fn, F8E4M3FN);
host_element!(f16, F16);
host_element!(bf16, BF16);
host_element!(f32, F32);
host_element!(f64, F64);

impl HostBuffer {
    pub fn dtype(&self) -> DType {
        match self {
            HostBuffer::Bool(_) => DType::Bool,
            HostBuffer::U8(_) => DType::U8,
            HostBuffer::I8(_) => DType::I8,
            HostBuffer::I16(_) => DType::I16,
            HostBuffer::I32(_) => DType::I32,
            HostBuffer::I64(_) => DType::I64,
            HostBuffer::F8E5M2(_) => DType::F8E5M2,
            HostBuffer::F8E4M3FN(_) => DType::F8E4M3FN,
            HostBuffer::F16(_) => DType::F16,
            HostBuffer::BF16(_) => DType::BF16,
            HostBuffer::F32(_) => DType::F32,
            HostBuffer::F64(_) => DType::F64,
        }
    }
    pub fn len(&self) -> usize {
        with_host_buffer!(self, v => v.len())
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// A zero-filled buffer.
    pub fn zeros(dtype: DType, len: usize) -> HostBuffer {
        with_dtype!(dtype, T => T::into_buffer(vec![<T as Element>::zero(); len]))
    }
    /// Typed view of the data, or `None` when `T` is not this buffer's type.
    pub fn as_slice<T: HostElement>(&self) -> Option<&[T]> {
        T::slice(self)
    }
    pub fn as_mut_slice<T: HostElement>(&mut self) -> Option<&mut [T]> {
        T::slice_mut(self)
    }
    /// Element `i` as f64 (exact for all but huge i64 values).
    pub fn get_f64(&self, i: usize) -> f64 {
        with_host_buffer!(self, v => v[i].to_f64())
    }
    pub fn get_i64(&self, i: usize) -> i64 {
        with_host_buffer!(self, v => v[i].to_i64())
    }
    /// Raw little-endian bytes (the safetensors layout).
    pub fn to_le_bytes(&self) -> Vec<u8> {
        fn bytes<T: Copy, const N: usize>(v: &[T], f: impl Fn(T) -> [u8; N]) -> Vec<u8> {
            v.iter().flat_map(|&x| f(x)).collect()
        }
        match self {
            HostBuffer::Bool(v) => v.iter().map(|&b| b as u8).collect(),
            HostBuffer::U8(v) => v.clone(),
            HostBuffer::I8(v) => bytes(v, |x| x.to_le_bytes()),
            HostBuffer::I16(v) => bytes(v, |x| x.to_le_bytes()),
            HostBuffer::I32(v) => bytes(v, |x| x.to_le_bytes()),
            HostBuffer::I64(v) => bytes(v, |x| x.to_le_bytes()),
            HostBuffer::F8E5M2(v) => v.iter().map(|x| x.to_bits()).collect(),
            HostBuffer::F8E4M3FN(v) => v.iter().map(|x| x.to_bits()).collect(),
            HostBuffer::F16(v) => bytes(v, |x| x.to_le_bytes()),
            HostBuffer::BF16(v) => bytes(v, |x| x.to_le_bytes()),
            HostBuffer::F32(v) => bytes(v, |x| x.to_le_bytes()),
            HostBuffer::F64(v) => bytes(v, |x| x.to_le_bytes()),
        }
    }
    /// Decodes little-endian bytes of `dtype`; the length must be a multiple of the element size.
    pub fn from_le_bytes(dtype: DType, b: &[u8]) -> Result<HostBuffer> {
        let es = dtype.size_in_bytes();
        if !b.len().is_multiple_of(es) {
            return Err(Error::invalid(
                "from_le_bytes",
                format!("{} bytes is not a whole number of {dtype} elements ({es} bytes each)", b.len()),
            ));
        }
        macro_rules! dec {
            ($t:ty, $v:ident, $n:literal) => {
                HostBuffer::$v(b.chunks_exact($n).map(|c| <$t>::from_le_bytes(c.try_into().unwrap())).collect())
            };
        }
        Ok(match dtype {
            DType::Bool => HostBuffer::Bool(b.iter().map(|&x| x != 0).collect()),
            DType::U8 => HostBuffer::U8(b.to_vec()),
            DType::I8 => dec!(i8, I8, 1),
            DType::I16 => dec!(i16, I16, 2),
            DType::I32 => dec!(i32, I32, 4),
            DType::I64 => dec!(i64, I64, 8),
            DType::F8E5M2 => HostBuffer::F8E5M2(b.iter().map(|&x| f8e5m2::from_bits(x)).collect()),
            DType::F8E4M3FN => HostBuffer::F8E4M3FN(b.iter().map(|&x| f8e4m3fn::from_bits(x)).collect()),
            DType::F16 => dec!(f16, F16, 2),
            DType::BF16 => dec!(bf16, BF16, 2),
            DType::F32 => dec!(f32, F32, 4),
            DType::F64 => dec!(f64, F64, 8),
        })
    }
}

/// Memory owned by a non-host backend (a device buffer). The tensor crate only
/// moves it around; the backend that made it downcasts it back through `as_any`.
pub trait DeviceBuffer: Send + Sync + std::fmt::Debug {
    fn as_any(&self) -> &dyn Any;
    fn as_any_mut(&mut self) -> &mut dyn Any;
    /// A second handle on the same device memory (for a backend whose
    /// buffers are immutable and reference-counted), or `None` when the
    /// memory cannot be shared. Deferred programs (Note \[Deferred programs\])
    /// read their parameters through such handles.
    fn share(&self) -> Option<Box<dyn DeviceBuffer>> {
        None
    }
}

/// What a storage holds: host memory, a backend's device buffer, or nothing
/// yet: the value of an op recorded while a function is traced (Note
/// \[Recording\]), which exists once the traced program runs, or the value
/// of a deferred op (Note \[Deferred programs\]), which exists once the
/// device's pending program runs.
#[derive(Debug)]
pub enum StorageData {
    Host(HostBuffer),
    Device(Box<dyn DeviceBuffer>),
    Traced,
    Pending,
}

impl StorageData {
    pub fn as_host(&self) -> Option<&HostBuffer> {
        match self {
            StorageData::Host(h) => Some(h),
            StorageData::Device(_) | StorageData::Traced | StorageData::Pending => None,
        }
    }
    pub fn as_host_mut(&mut self) -> Option<&mut HostBuffer> {
        match self {
            StorageData::Host(h) => Some(h),
            StorageData::Device(_) | StorageData::Traced | StorageData::Pending => None,
        }
    }
    /// A second handle on the same data (see [`DeviceBuffer::share`]).
    pub fn share(&self) -> Option<StorageData> {
        match self {
            StorageData::Device(d) => d.share().map(StorageData::Device),
            StorageData::Host(_) | StorageData::Traced | StorageData::Pending => None,
        }
    }
    /// The host memory, or an error saying what the storage holds instead
    /// (for a backend whose storages live on the host).
    pub fn host(&self, backend: &'static str) -> crate::Result<&HostBuffer> {
        self.as_host().ok_or_else(|| self.not_here(backend))
    }
    /// [`StorageData::host`], mutably.
    pub fn host_mut(&mut self, backend: &'static str) -> crate::Result<&mut HostBuffer> {
        match self {
            StorageData::Host(h) => Ok(h),
            other => Err(other.not_here(backend)),
        }
    }
    /// The error for a storage whose data is not what `backend` keeps.
    pub fn not_here(&self, backend: &'static str) -> crate::Error {
        match self {
            StorageData::Traced => crate::Error::invalid(
                backend,
                "the tensor is a value of a function being traced by kiln::compile, which exists once its program runs (a tensor made inside a traced function and kept after its trace failed, or read while tracing)",
            ),
            StorageData::Pending => crate::Error::invalid(
                backend,
                "the tensor is the value of a deferred op whose program did not run (an earlier error stopped it)",
            ),
            StorageData::Host(_) => crate::Error::backend(backend, "the tensor holds host memory, not this backend's buffer"),
            StorageData::Device(_) => crate::Error::backend(backend, "the tensor holds another backend's buffer"),
        }
    }
}

// Note [Storage mutability]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// A `Storage` is shared (through `Arc`) by a base tensor and all of its views,
// and in-place ops write through any of them, so the memory needs interior
// mutability. kiln puts it behind a `RwLock`: any number of ops may read a
// storage at once, and a write (an in-place op, `copy_`, `index_put_`) takes the
// lock exclusively for the duration of its kernel. A reader on another thread
// therefore sees the storage either entirely before or entirely after a write,
// never half of it, and no data race is possible through the safe API
// (`Tensor` is `Send + Sync`). Uncontended, the lock costs a few nanoseconds,
// far below the cost of dispatching an op.
//
// An in-place op (`add_`, `masked_fill_`, `index_put_`, `copy_`, ...) reads
// its destination, computes out of place and writes back: a read-modify-write
// that must not interleave with another on the same storage, or one of the two
// updates is lost (two threads doing `x.add_(1.0)` 2,000 times each must end
// at 4,000). So every in-place op also holds the storage's in-place lock
// (`Storage::exclusive`) from before its first read of the destination to
// after its write. It is reentrant on one thread (an in-place op calling
// `copy_`), and an in-place op never writes another storage while holding it,
// so it adds no lock cycle: readers and out-of-place ops never take it.
//
// Deadlock freedom: a kernel that writes one storage while reading others
// takes all its locks in one global order (by storage address, see
// `Storage::lock_ordered`), and a write whose destination is also one of its
// inputs is first computed out of place (read locks only), then copied in.
// So no two threads can each hold a lock the other waits for.
//
// The alternatives were rejected: `UnsafeCell` with "the user promises" (what
// candle's CPU storage and PyTorch do) makes a data race possible from safe
// code; copy-on-write would break PyTorch's aliasing semantics, where a write
// through a view must be seen by the base.

/// Memory shared by a base tensor and its views, with the version counter.
#[derive(Debug)]
pub struct Storage {
    data: RwLock<StorageData>,
    /// Serialises in-place read-modify-writes (see Note [Storage mutability]).
    inplace: Mutex<()>,
    version: AtomicU64,
    dtype: DType,
    len: usize,
    device: Device,
}

static LIVE_STORAGES: AtomicU64 = AtomicU64::new(0);

/// How many storages are alive in the process: a leak detector for tests
/// (a training loop must not grow it step after step).
pub fn live_storages() -> u64 {
    LIVE_STORAGES.load(Ordering::Relaxed)
}

impl Drop for Storage {
    fn drop(&mut self) {
        LIVE_STORAGES.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Storage {
    pub fn new(data: StorageData, dtype: DType, len: usize, device: Device) -> Storage {
        LIVE_STORAGES.fetch_add(1, Ordering::Relaxed);
        Storage { data: RwLock::new(data), inplace: Mutex::new(()), version: AtomicU64::new(0), dtype, len, device }
    }
    pub fn from_host(buf: HostBuffer, device: Device) -> Storage {
        let (dtype, len) = (buf.dtype(), buf.len());
        Storage::new(StorageData::Host(buf), dtype, len, device)
    }
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn device(&self) -> Device {
        self.device
    }
    /// The version counter: bumped by every in-place write through any view.
    pub fn version(&self) -> u64 {
        self.version.load(Ordering::Acquire)
    }
    pub fn bump_version(&self) {
        self.version.fetch_add(1, Ordering::AcqRel);
    }
    /// Shared read access (see Note [Storage mutability]).
    pub fn read(&self) -> RwLockReadGuard<'_, StorageData> {
        // A panic inside a kernel cannot leave the data half-typed, so a poisoned lock is still usable.
        self.data.read().unwrap_or_else(|e| e.into_inner())
    }
    /// Exclusive write access (see Note [Storage mutability]). Does not bump the version:
    /// the tensor layer does that once per logical in-place op.
    pub fn write(&self) -> RwLockWriteGuard<'_, StorageData> {
        self.data.write().unwrap_or_else(|e| e.into_inner())
    }
    /// Replaces the contents (used by backends whose buffers are immutable).
    pub fn replace(&self, data: StorageData) {
        *self.write() = data;
    }
    /// Moves the contents out, leaving an empty host buffer: for a storage
    /// about to be dropped whose data goes into another one (`replace`).
    pub fn take_data(&self) -> StorageData {
        std::mem::replace(&mut *self.write(), StorageData::Host(HostBuffer::zeros(self.dtype, 0)))
    }
    /// A stable identity for ordering locks and detecting aliasing.
    pub fn addr(&self) -> usize {
        self as *const Storage as usize
    }
    /// The in-place lock, held by an in-place op from its first read of this
    /// storage to its write (see Note [Storage mutability]); reentrant on one thread.
    pub fn exclusive(&self) -> Exclusive<'_> {
        let addr = self.addr();
        if HELD.with(|h| h.borrow().contains(&addr)) {
            return Exclusive { guard: None, addr };
        }
        let guard = self.inplace.lock().unwrap_or_else(|e| e.into_inner());
        HELD.with(|h| h.borrow_mut().push(addr));
        Exclusive { guard: Some(guard), addr }
    }
}

thread_local! {
    /// The storages whose in-place lock this thread holds.
    static HELD: std::cell::RefCell<Vec<usize>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Whether this thread holds any storage's in-place lock.
pub(crate) fn holds_exclusive() -> bool {
    HELD.with(|h| !h.borrow().is_empty())
}

/// A held in-place lock (see [`Storage::exclusive`]).
pub struct Exclusive<'a> {
    guard: Option<MutexGuard<'a, ()>>,
    addr: usize,
}

impl Drop for Exclusive<'_> {
    fn drop(&mut self) {
        if self.guard.is_some() {
            HELD.with(|h| h.borrow_mut().retain(|&a| a != self.addr));
        }
    }
}
