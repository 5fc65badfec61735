//! The key-value store a PJRT plugin reads and writes while it creates a
//! multi-process client (GPU and TPU plugins exchange topology and
//! communicator ids this way): `PJRT_Client_Create`'s get / try-get / put
//! callbacks, answered from a [`TcpStore`]. Keys are prefixed with `pjrt/`
//! so that they cannot collide with the process group's own.
use super::ffi;
use crate::store::TcpStore;
use std::ffi::{c_char, c_void};
use std::time::Duration;

/// The prefix of every key a plugin uses.
pub const KEY_PREFIX: &str = "pjrt/";

/// The callbacks and their `user_arg` for `PJRT_Client_Create_Args`.
pub(crate) fn install(a: &mut ffi::PJRT_Client_Create_Args, store: &'static TcpStore) {
    let user = store as *const TcpStore as *mut c_void;
    a.kv_get_callback = kv_get as *mut c_void;
    a.kv_get_user_arg = user;
    a.kv_try_get_callback = kv_try_get as *mut c_void;
    a.kv_try_get_user_arg = user;
    a.kv_put_callback = kv_put as *mut c_void;
    a.kv_put_user_arg = user;
}

/// The key the plugin passed, prefixed.
///
/// # Safety
/// `key` must point to `len` readable bytes (or be null with `len` 0).
unsafe fn key_of(key: *const c_char, len: usize) -> String {
    if key.is_null() || len == 0 {
        return KEY_PREFIX.to_string();
    }
    // SAFETY: the caller guarantees `len` readable bytes at `key`.
    let b = unsafe { std::slice::from_raw_parts(key as *const u8, len) };
    format!("{KEY_PREFIX}{}", String::from_utf8_lossy(b))
}

/// The `PJRT_Error` for a failed callback, made by the plugin's own constructor.
///
/// # Safety
/// `make` must be the `callback_error` pointer the plugin passed (or null).
unsafe fn fail(make: *mut ffi::PJRT_CallbackError, code: std::ffi::c_int, msg: &str) -> *mut ffi::PJRT_Error {
    // SAFETY: a non-null `callback_error` points to the plugin's constructor.
    match unsafe { make.as_ref() }.copied().flatten() {
        // SAFETY: the constructor copies `msg` (a valid slice) before returning.
        Some(f) => unsafe { f(code, msg.as_ptr() as *const c_char, msg.len()) },
        None => std::ptr::null_mut(),
    }
}

/// Hands `value` to the plugin: a heap copy with its length in front, freed by [`free_value`].
fn give(value: Vec<u8>) -> (*mut c_char, usize) {
    let n = value.len();
    let mut boxed = Vec::with_capacity(8 + n);
    boxed.extend_from_slice(&(n as u64).to_le_bytes());
    boxed.extend_from_slice(&value);
    let raw = Box::into_raw(boxed.into_boxed_slice()) as *mut u8;
    // SAFETY: the allocation holds 8 + n bytes; the value starts after the length.
    (unsafe { raw.add(8) } as *mut c_char, n)
}

/// The deleter of values made by [`give`].
unsafe extern "C" fn free_value(value: *mut c_char) {
    if value.is_null() {
        return;
    }
    // SAFETY: `value` came from `give`: 8 bytes before it hold the value's
    // length, and the whole allocation is a boxed slice of 8 + length bytes.
    unsafe {
        let start = (value as *mut u8).sub(8);
        let n = u64::from_le_bytes(std::ptr::read_unaligned(start as *const [u8; 8])) as usize;
        drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(start, 8 + n)));
    }
}

/// Fills a get callback's answer from the store's `lookup`: the value (with
/// its deleter), or the plugin's error with `missing` for an absent key.
///
/// # Safety
/// `make` must be the `callback_error` pointer the plugin passed.
unsafe fn answer(
    lookup: impl FnOnce() -> kiln_tensor::Result<Option<Vec<u8>>>,
    out: (&mut *mut c_char, &mut usize, &mut ffi::PJRT_KeyValueGetCallback_ValueDeleter),
    make: *mut ffi::PJRT_CallbackError,
    missing: (std::ffi::c_int, String),
) -> *mut ffi::PJRT_Error {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(lookup)) {
        Ok(Ok(Some(v))) => {
            (*out.0, *out.1) = give(v);
            *out.2 = Some(free_value);
            std::ptr::null_mut()
        }
        // SAFETY: the plugin's error constructor (the caller's promise).
        Ok(Ok(None)) => unsafe { fail(make, missing.0, &missing.1) },
        // SAFETY: as above.
        Ok(Err(e)) => unsafe { fail(make, ffi::ERROR_INTERNAL, &e.to_string()) },
        // SAFETY: as above.
        Err(_) => unsafe { fail(make, ffi::ERROR_INTERNAL, "the key-value store panicked") },
    }
}

unsafe extern "C" fn kv_get(args: *mut ffi::PJRT_KeyValueGetCallback_Args) -> *mut ffi::PJRT_Error {
    // SAFETY: the plugin passes a valid, exclusive argument struct.
    let a = unsafe { &mut *args };
    // SAFETY: `user_arg` is the `&'static TcpStore` `install` gave.
    let store = unsafe { &*(a.user_arg as *const TcpStore) };
    // SAFETY: the plugin's key pointer and length.
    let key = unsafe { key_of(a.key, a.key_size) };
    let timeout = Duration::from_millis(a.timeout_in_ms.max(0) as u64);
    let missing = (ffi::ERROR_DEADLINE_EXCEEDED, format!("no value for {key:?} after {timeout:?}"));
    let out = (&mut a.value, &mut a.value_size, &mut a.value_deleter_callback);
    // SAFETY: `callback_error` is the plugin's.
    unsafe { answer(|| store.wait_for(&key, timeout), out, a.callback_error, missing) }
}

unsafe extern "C" fn kv_try_get(args: *mut ffi::PJRT_KeyValueTryGetCallback_Args) -> *mut ffi::PJRT_Error {
    // SAFETY: as in `kv_get`.
    let a = unsafe { &mut *args };
    // SAFETY: as in `kv_get`.
    let store = unsafe { &*(a.user_arg as *const TcpStore) };
    // SAFETY: as in `kv_get`.
    let key = unsafe { key_of(a.key, a.key_size) };
    let missing = (ffi::ERROR_NOT_FOUND, format!("no value for {key:?}"));
    let out = (&mut a.value, &mut a.value_size, &mut a.value_deleter_callback);
    // SAFETY: `callback_error` is the plugin's.
    unsafe { answer(|| store.try_get(&key), out, a.callback_error, missing) }
}

unsafe extern "C" fn kv_put(args: *mut ffi::PJRT_KeyValuePutCallback_Args) -> *mut ffi::PJRT_Error {
    // SAFETY: as in `kv_get`.
    let a = unsafe { &mut *args };
    // SAFETY: as in `kv_get`.
    let store = unsafe { &*(a.user_arg as *const TcpStore) };
    // SAFETY: as in `kv_get`.
    let key = unsafe { key_of(a.key, a.key_size) };
    let value = if a.value.is_null() || a.value_size == 0 {
        &[][..]
    } else {
        // SAFETY: the plugin passes `value_size` readable bytes at `value`.
        unsafe { std::slice::from_raw_parts(a.value as *const u8, a.value_size) }
    };
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| store.put(&key, value))) {
        Ok(Ok(())) => std::ptr::null_mut(),
        // SAFETY: the plugin's error constructor.
        Ok(Err(e)) => unsafe { fail(a.callback_error, ffi::ERROR_INTERNAL, &e.to_string()) },
        // SAFETY: as above.
        Err(_) => unsafe { fail(a.callback_error, ffi::ERROR_INTERNAL, "the key-value store panicked") },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ffi::Args;

    /// The callbacks as a plugin calls them, against a live store.
    #[test]
    fn the_callbacks_answer_from_the_store() {
        let server = TcpStore::serve("127.0.0.1:0".parse().unwrap()).unwrap();
        let store: &'static TcpStore =
            Box::leak(Box::new(TcpStore::connect(server.addr(), Duration::from_secs(5)).unwrap()));
        let mut c = ffi::PJRT_Client_Create_Args::new();
        install(&mut c, store);
        let user = c.kv_put_user_arg;
        let key = b"topology";
        let value = [0u8, 1, 2, 255, 0];
        let mut p = ffi::PJRT_KeyValuePutCallback_Args::new();
        (p.key, p.key_size, p.value, p.value_size, p.user_arg) =
            (key.as_ptr() as _, key.len(), value.as_ptr() as _, value.len(), user);
        // SAFETY: a valid argument struct, as a plugin passes it.
        assert!(unsafe { kv_put(&mut p) }.is_null());
        assert_eq!(store.try_get("pjrt/topology").unwrap().unwrap(), value);
        let mut g = ffi::PJRT_KeyValueGetCallback_Args::new();
        (g.key, g.key_size, g.timeout_in_ms, g.user_arg) = (key.as_ptr() as _, key.len(), 1000, user);
        // SAFETY: as above.
        assert!(unsafe { kv_get(&mut g) }.is_null());
        // SAFETY: the callback returned `value_size` bytes at `value`.
        let got = unsafe { std::slice::from_raw_parts(g.value as *const u8, g.value_size) }.to_vec();
        assert_eq!(got, value);
        // SAFETY: the deleter the callback gave, for its value, once.
        unsafe { g.value_deleter_callback.unwrap()(g.value) };
        // Missing keys: errors made by the plugin's constructor, with their codes.
        static CODE: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);
        unsafe extern "C" fn make(code: std::ffi::c_int, _: *const c_char, _: usize) -> *mut ffi::PJRT_Error {
            CODE.store(code, std::sync::atomic::Ordering::Relaxed);
            std::ptr::NonNull::dangling().as_ptr()
        }
        let mut make_err: ffi::PJRT_CallbackError = Some(make);
        let missing = b"absent";
        let mut t = ffi::PJRT_KeyValueTryGetCallback_Args::new();
        (t.key, t.key_size, t.user_arg, t.callback_error) = (missing.as_ptr() as _, missing.len(), user, &mut make_err);
        // SAFETY: as above.
        assert!(!unsafe { kv_try_get(&mut t) }.is_null() && t.value.is_null());
        assert_eq!(CODE.load(std::sync::atomic::Ordering::Relaxed), ffi::ERROR_NOT_FOUND);
        let mut g = ffi::PJRT_KeyValueGetCallback_Args::new();
        (g.key, g.key_size, g.timeout_in_ms, g.user_arg, g.callback_error) =
            (missing.as_ptr() as _, missing.len(), 50, user, &mut make_err);
        // SAFETY: as above.
        assert!(!unsafe { kv_get(&mut g) }.is_null() && g.value.is_null());
        assert_eq!(CODE.load(std::sync::atomic::Ordering::Relaxed), ffi::ERROR_DEADLINE_EXCEEDED);
    }
}
