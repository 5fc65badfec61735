//! `#[repr(C)]` declarations of the part of the PJRT C API kiln uses, written
//! by hand to the layout of the published header `pjrt_c_api.h`, API version
//! 0.81 (see Note [PJRT struct sizes]).
#![allow(non_camel_case_types, dead_code)]

use std::ffi::{c_char, c_int, c_void};

// Note [PJRT struct sizes]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// Every argument struct of the C API starts with `struct_size` and
// `extension_start`. A plugin reads `struct_size` to learn which fields the
// caller knows about: fields are only ever appended, and a plugin refuses
// structs smaller than the oldest layout it still supports. kiln declares the
// 0.81 layout and sets `struct_size = size_of::<Args>()` (which may include
// trailing padding, i.e. a few bytes more than the header's `offsetof(last) +
// sizeof(last)`; plugins only check for "at least"). Plugins with API 0.81 up
// to at least 0.115 accept these layouts. The function table `PJRT_Api` is
// append-only too: kiln checks the plugin's table is long enough for every
// entry it calls.

/// Opaque handles.
#[repr(C)]
pub struct PJRT_Error {
    _p: [u8; 0],
}
#[repr(C)]
pub struct PJRT_Client {
    _p: [u8; 0],
}
#[repr(C)]
pub struct PJRT_Device {
    _p: [u8; 0],
}
#[repr(C)]
pub struct PJRT_DeviceDescription {
    _p: [u8; 0],
}
#[repr(C)]
pub struct PJRT_Buffer {
    _p: [u8; 0],
}
#[repr(C)]
pub struct PJRT_Event {
    _p: [u8; 0],
}
#[repr(C)]
pub struct PJRT_Executable {
    _p: [u8; 0],
}
#[repr(C)]
pub struct PJRT_LoadedExecutable {
    _p: [u8; 0],
}
#[repr(C)]
pub struct PJRT_SerializedExecutable {
    _p: [u8; 0],
}

/// Every API entry takes a pointer to its argument struct and returns an error or null.
pub type ApiFn = Option<unsafe extern "C" fn(args: *mut c_void) -> *mut PJRT_Error>;

#[repr(C)]
pub struct PJRT_Api_Version {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub major_version: c_int,
    pub minor_version: c_int,
}

/// The function table, in the header's order (append-only across versions).
#[repr(C)]
pub struct PJRT_Api {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub pjrt_api_version: PJRT_Api_Version,

    pub error_destroy: ApiFn,
    pub error_message: ApiFn,
    pub error_get_code: ApiFn,
    pub plugin_initialize: ApiFn,
    pub plugin_attributes: ApiFn,
    pub event_destroy: ApiFn,
    pub event_is_ready: ApiFn,
    pub event_error: ApiFn,
    pub event_await: ApiFn,
    pub event_on_ready: ApiFn,
    pub client_create: ApiFn,
    pub client_destroy: ApiFn,
    pub client_platform_name: ApiFn,
    pub client_process_index: ApiFn,
    pub client_platform_version: ApiFn,
    pub client_devices: ApiFn,
    pub client_addressable_devices: ApiFn,
    pub client_lookup_device: ApiFn,
    pub client_lookup_addressable_device: ApiFn,
    pub client_addressable_memories: ApiFn,
    pub client_compile: ApiFn,
    pub client_default_device_assignment: ApiFn,
    pub client_buffer_from_host_buffer: ApiFn,
    pub device_description_id: ApiFn,
    pub device_description_process_index: ApiFn,
    pub device_description_attributes: ApiFn,
    pub device_description_kind: ApiFn,
    pub device_description_debug_string: ApiFn,
    pub device_description_to_string: ApiFn,
    pub device_get_description: ApiFn,
    pub device_is_addressable: ApiFn,
    pub device_local_hardware_id: ApiFn,
    pub device_addressable_memories: ApiFn,
    pub device_default_memory: ApiFn,
    pub device_memory_stats: ApiFn,
    pub memory_id: ApiFn,
    pub memory_kind: ApiFn,
    pub memory_debug_string: ApiFn,
    pub memory_to_string: ApiFn,
    pub memory_addressable_by_devices: ApiFn,
    pub executable_destroy: ApiFn,
    pub executable_name: ApiFn,
    pub executable_num_replicas: ApiFn,
    pub executable_num_partitions: ApiFn,
    pub executable_num_outputs: ApiFn,
    pub executable_size_of_generated_code_in_bytes: ApiFn,
    pub executable_get_cost_analysis: ApiFn,
    pub executable_output_memory_kinds: ApiFn,
    pub executable_optimized_program: ApiFn,
    pub executable_serialize: ApiFn,
    pub loaded_executable_destroy: ApiFn,
    pub loaded_executable_get_executable: ApiFn,
    pub loaded_executable_addressable_devices: ApiFn,
    pub loaded_executable_delete: ApiFn,
    pub loaded_executable_is_deleted: ApiFn,
    pub loaded_executable_execute: ApiFn,
    pub executable_deserialize_and_load: ApiFn,
    pub loaded_executable_fingerprint: ApiFn,
    pub buffer_destroy: ApiFn,
    pub buffer_element_type: ApiFn,
    pub buffer_dimensions: ApiFn,
    pub buffer_unpadded_dimensions: ApiFn,
    pub buffer_dynamic_dimension_indices: ApiFn,
    pub buffer_get_memory_layout: ApiFn,
    pub buffer_on_device_size_in_bytes: ApiFn,
    pub buffer_device: ApiFn,
    pub buffer_memory: ApiFn,
    pub buffer_delete: ApiFn,
    pub buffer_is_deleted: ApiFn,
    pub buffer_copy_to_device: ApiFn,
    pub buffer_to_host_buffer: ApiFn,
    pub buffer_is_on_cpu: ApiFn,
    pub buffer_ready_event: ApiFn,
    // Entries past this point are not called by kiln; the table is declared up
    // to the last one it calls, so the length check below covers them all.
}

#[repr(C)]
pub struct PJRT_Error_Destroy_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub error: *mut PJRT_Error,
}

#[repr(C)]
pub struct PJRT_Error_Message_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub error: *const PJRT_Error,
    pub message: *const c_char,
    pub message_size: usize,
}

#[repr(C)]
pub struct PJRT_Error_GetCode_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub error: *const PJRT_Error,
    pub code: c_int,
}

pub const NAMED_VALUE_STRING: c_int = 0;
pub const NAMED_VALUE_INT64: c_int = 1;
pub const NAMED_VALUE_INT64_LIST: c_int = 2;
pub const NAMED_VALUE_FLOAT: c_int = 3;
pub const NAMED_VALUE_BOOL: c_int = 4;

/// The value union of `PJRT_NamedValue` (8 bytes: a pointer or an int64).
#[repr(C)]
#[derive(Clone, Copy)]
pub union NamedValueUnion {
    pub string_value: *const c_char,
    pub int64_value: i64,
    pub int64_array_value: *const i64,
    pub float_value: f32,
    pub bool_value: bool,
}

#[repr(C)]
pub struct PJRT_NamedValue {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub name: *const c_char,
    pub name_size: usize,
    pub kind: c_int,
    pub value: NamedValueUnion,
    pub value_size: usize,
}

#[repr(C)]
pub struct PJRT_Plugin_Initialize_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
}

#[repr(C)]
pub struct PJRT_Plugin_Attributes_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub attributes: *const PJRT_NamedValue,
    pub num_attributes: usize,
}

/// The argument of `Event_Destroy`, `Event_Error` and `Event_Await` (same layout).
#[repr(C)]
pub struct PJRT_Event_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub event: *mut PJRT_Event,
}

#[repr(C)]
pub struct PJRT_Event_IsReady_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub event: *mut PJRT_Event,
    pub is_ready: bool,
}

#[repr(C)]
pub struct PJRT_Client_Create_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub create_options: *const PJRT_NamedValue,
    pub num_options: usize,
    pub kv_get_callback: *mut c_void,
    pub kv_get_user_arg: *mut c_void,
    pub kv_put_callback: *mut c_void,
    pub kv_put_user_arg: *mut c_void,
    pub client: *mut PJRT_Client,
    pub kv_try_get_callback: *mut c_void,
    pub kv_try_get_user_arg: *mut c_void,
}

/// `PJRT_CallbackError`: makes the `PJRT_Error` a key-value callback returns.
pub type PJRT_CallbackError =
    Option<unsafe extern "C" fn(code: c_int, message: *const c_char, message_size: usize) -> *mut PJRT_Error>;
/// Frees a value a key-value get callback returned.
pub type PJRT_KeyValueGetCallback_ValueDeleter = Option<unsafe extern "C" fn(value: *mut c_char)>;

/// The argument of the blocking get callback (`PJRT_KeyValueGetCallback_Args`).
#[repr(C)]
pub struct PJRT_KeyValueGetCallback_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub key: *const c_char,
    pub key_size: usize,
    pub timeout_in_ms: c_int,
    pub callback_error: *mut PJRT_CallbackError,
    pub user_arg: *mut c_void,
    pub value: *mut c_char,
    pub value_size: usize,
    pub value_deleter_callback: PJRT_KeyValueGetCallback_ValueDeleter,
}

/// The argument of the non-blocking get callback (`PJRT_KeyValueTryGetCallback_Args`).
#[repr(C)]
pub struct PJRT_KeyValueTryGetCallback_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub key: *const c_char,
    pub key_size: usize,
    pub callback_error: *mut PJRT_CallbackError,
    pub user_arg: *mut c_void,
    pub value: *mut c_char,
    pub value_size: usize,
    pub value_deleter_callback: PJRT_KeyValueGetCallback_ValueDeleter,
}

/// The argument of the put callback (`PJRT_KeyValuePutCallback_Args`).
#[repr(C)]
pub struct PJRT_KeyValuePutCallback_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub key: *const c_char,
    pub key_size: usize,
    pub value: *const c_char,
    pub value_size: usize,
    pub callback_error: *mut PJRT_CallbackError,
    pub user_arg: *mut c_void,
}

/// `PJRT_Error_Code` values the key-value callbacks return.
pub const ERROR_DEADLINE_EXCEEDED: c_int = 4;
pub const ERROR_NOT_FOUND: c_int = 5;
pub const ERROR_INTERNAL: c_int = 13;

#[repr(C)]
pub struct PJRT_Client_Destroy_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub client: *mut PJRT_Client,
}

/// The argument of `Client_PlatformName` and `Client_PlatformVersion` (same layout).
#[repr(C)]
pub struct PJRT_Client_String_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub client: *mut PJRT_Client,
    pub value: *const c_char,
    pub value_size: usize,
}

#[repr(C)]
pub struct PJRT_Client_Devices_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub client: *mut PJRT_Client,
    pub devices: *const *mut PJRT_Device,
    pub num_devices: usize,
}

#[repr(C)]
pub struct PJRT_Program {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub code: *mut c_char,
    pub code_size: usize,
    pub format: *const c_char,
    pub format_size: usize,
}

#[repr(C)]
pub struct PJRT_Client_Compile_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub client: *mut PJRT_Client,
    pub program: *const PJRT_Program,
    pub compile_options: *const c_char,
    pub compile_options_size: usize,
    pub executable: *mut PJRT_LoadedExecutable,
}

pub const BUFFER_TYPE_PRED: c_int = 1;
pub const BUFFER_TYPE_S8: c_int = 2;
pub const BUFFER_TYPE_S16: c_int = 3;
pub const BUFFER_TYPE_S32: c_int = 4;
pub const BUFFER_TYPE_S64: c_int = 5;
pub const BUFFER_TYPE_U8: c_int = 6;
pub const BUFFER_TYPE_F16: c_int = 10;
pub const BUFFER_TYPE_F32: c_int = 11;
pub const BUFFER_TYPE_F64: c_int = 12;
pub const BUFFER_TYPE_BF16: c_int = 13;
pub const BUFFER_TYPE_F8E5M2: c_int = 16;
pub const BUFFER_TYPE_F8E4M3FN: c_int = 17;

/// `PJRT_HostBufferSemantics_kImmutableOnlyDuringCall`: the plugin copies the
/// host data before `BufferFromHostBuffer` returns.
pub const HOST_BUFFER_IMMUTABLE_ONLY_DURING_CALL: c_int = 0;
/// `kImmutableUntilTransferCompletes`: the host data must stay alive and
/// unchanged until the `done_with_host_buffer` event fires.
pub const HOST_BUFFER_IMMUTABLE_UNTIL_TRANSFER_COMPLETES: c_int = 1;

#[repr(C)]
pub struct PJRT_Client_BufferFromHostBuffer_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub client: *mut PJRT_Client,
    pub data: *const c_void,
    pub kind: c_int,
    pub dims: *const i64,
    pub num_dims: usize,
    pub byte_strides: *const i64,
    pub num_byte_strides: usize,
    pub host_buffer_semantics: c_int,
    pub device: *mut PJRT_Device,
    pub memory: *mut c_void,
    pub device_layout: *mut c_void,
    pub done_with_host_buffer: *mut PJRT_Event,
    pub buffer: *mut PJRT_Buffer,
}

#[repr(C)]
pub struct PJRT_DeviceDescription_Id_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub device_description: *mut PJRT_DeviceDescription,
    pub id: c_int,
}

#[repr(C)]
pub struct PJRT_DeviceDescription_Kind_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub device_description: *mut PJRT_DeviceDescription,
    pub device_kind: *const c_char,
    pub device_kind_size: usize,
}

#[repr(C)]
pub struct PJRT_Device_GetDescription_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub device: *mut PJRT_Device,
    pub device_description: *mut PJRT_DeviceDescription,
}

#[repr(C)]
pub struct PJRT_Executable_Destroy_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub executable: *mut PJRT_Executable,
}

#[repr(C)]
pub struct PJRT_Executable_NumOutputs_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub executable: *mut PJRT_Executable,
    pub num_outputs: usize,
}

#[repr(C)]
pub struct PJRT_Executable_Serialize_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub executable: *const PJRT_Executable,
    pub serialized_bytes: *const c_char,
    pub serialized_bytes_size: usize,
    pub serialized_executable: *mut PJRT_SerializedExecutable,
    pub serialized_executable_deleter: Option<unsafe extern "C" fn(*mut PJRT_SerializedExecutable)>,
}

#[repr(C)]
pub struct PJRT_LoadedExecutable_Destroy_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub executable: *mut PJRT_LoadedExecutable,
}

#[repr(C)]
pub struct PJRT_LoadedExecutable_GetExecutable_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub loaded_executable: *mut PJRT_LoadedExecutable,
    pub executable: *mut PJRT_Executable,
}

#[repr(C)]
pub struct PJRT_LoadedExecutable_AddressableDevices_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub executable: *mut PJRT_LoadedExecutable,
    pub addressable_devices: *const *mut PJRT_Device,
    pub num_addressable_devices: usize,
}

#[repr(C)]
pub struct PJRT_ExecuteOptions {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub send_callbacks: *mut c_void,
    pub recv_callbacks: *mut c_void,
    pub num_send_ops: usize,
    pub num_recv_ops: usize,
    pub launch_id: c_int,
    pub non_donatable_input_indices: *const i64,
    pub num_non_donatable_input_indices: usize,
    pub context: *mut c_void,
    pub call_location: *const c_char,
    pub num_tasks: usize,
    pub task_ids: *mut c_int,
    pub incarnation_ids: *mut i64,
}

#[repr(C)]
pub struct PJRT_LoadedExecutable_Execute_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub executable: *mut PJRT_LoadedExecutable,
    pub options: *mut PJRT_ExecuteOptions,
    pub argument_lists: *const *const *mut PJRT_Buffer,
    pub num_devices: usize,
    pub num_args: usize,
    pub output_lists: *const *mut *mut PJRT_Buffer,
    pub device_complete_events: *mut *mut PJRT_Event,
    pub execute_device: *mut PJRT_Device,
}

#[repr(C)]
pub struct PJRT_Executable_DeserializeAndLoad_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub client: *mut PJRT_Client,
    pub serialized_executable: *const c_char,
    pub serialized_executable_size: usize,
    pub loaded_executable: *mut PJRT_LoadedExecutable,
    pub overridden_serialized_compile_options: *const c_char,
    pub overridden_serialized_compile_options_size: usize,
}

#[repr(C)]
pub struct PJRT_Buffer_Destroy_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub buffer: *mut PJRT_Buffer,
}

#[repr(C)]
pub struct PJRT_Buffer_ElementType_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub buffer: *mut PJRT_Buffer,
    pub kind: c_int,
}

#[repr(C)]
pub struct PJRT_Buffer_Dimensions_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub buffer: *mut PJRT_Buffer,
    pub dims: *const i64,
    pub num_dims: usize,
}

#[repr(C)]
pub struct PJRT_Buffer_ToHostBuffer_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub src: *mut PJRT_Buffer,
    pub host_layout: *mut c_void,
    pub dst: *mut c_void,
    pub dst_size: usize,
    pub event: *mut PJRT_Event,
}

#[repr(C)]
pub struct PJRT_Buffer_CopyToDevice_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub buffer: *mut PJRT_Buffer,
    pub dst_device: *mut PJRT_Device,
    pub dst_buffer: *mut PJRT_Buffer,
}

#[repr(C)]
pub struct PJRT_Buffer_ReadyEvent_Args {
    pub struct_size: usize,
    pub extension_start: *mut c_void,
    pub buffer: *mut PJRT_Buffer,
    pub event: *mut PJRT_Event,
}

/// An argument struct: zero-initialised with `struct_size` set.
pub trait Args: Sized {
    fn new() -> Self {
        // SAFETY: every `Args` type is a `#[repr(C)]` struct of integers, bools, raw
        // pointers, `Option<fn>` and unions of those, for all of which the all-zero bit
        // pattern is a valid value (0, false, null, None).
        let mut a: Self = unsafe { std::mem::zeroed() };
        // SAFETY: `struct_size: usize` is the first field of every `#[repr(C)]` `Args`
        // struct, so it sits at offset 0 of `a`, which is aligned for usize.
        unsafe { *(&mut a as *mut Self as *mut usize) = std::mem::size_of::<Self>() };
        a
    }
}
macro_rules! args {
    ($($t:ty),* $(,)?) => {$(impl Args for $t {})*};
}
args!(
    PJRT_Api_Version,
    PJRT_Error_Destroy_Args,
    PJRT_Error_Message_Args,
    PJRT_Error_GetCode_Args,
    PJRT_NamedValue,
    PJRT_Plugin_Initialize_Args,
    PJRT_Plugin_Attributes_Args,
    PJRT_Event_Args,
    PJRT_Event_IsReady_Args,
    PJRT_Client_Create_Args,
    PJRT_KeyValueGetCallback_Args,
    PJRT_KeyValueTryGetCallback_Args,
    PJRT_KeyValuePutCallback_Args,
    PJRT_Client_Destroy_Args,
    PJRT_Client_String_Args,
    PJRT_Client_Devices_Args,
    PJRT_Program,
    PJRT_Client_Compile_Args,
    PJRT_Client_BufferFromHostBuffer_Args,
    PJRT_DeviceDescription_Id_Args,
    PJRT_DeviceDescription_Kind_Args,
    PJRT_Device_GetDescription_Args,
    PJRT_Executable_Destroy_Args,
    PJRT_Executable_NumOutputs_Args,
    PJRT_Executable_Serialize_Args,
    PJRT_LoadedExecutable_Destroy_Args,
    PJRT_LoadedExecutable_GetExecutable_Args,
    PJRT_LoadedExecutable_AddressableDevices_Args,
    PJRT_ExecuteOptions,
    PJRT_LoadedExecutable_Execute_Args,
    PJRT_Executable_DeserializeAndLoad_Args,
    PJRT_Buffer_Destroy_Args,
    PJRT_Buffer_ElementType_Args,
    PJRT_Buffer_Dimensions_Args,
    PJRT_Buffer_ToHostBuffer_Args,
    PJRT_Buffer_CopyToDevice_Args,
    PJRT_Buffer_ReadyEvent_Args,
);

/// The number of bytes of `PJRT_Api` kiln reads: the plugin's table must be at least this long.
pub const API_TABLE_NEEDED: usize = std::mem::size_of::<PJRT_Api>();
