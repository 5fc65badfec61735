//! Reading and writing tensors: safetensors files (memory-mapped, any dtype
//! converted on load, atomic saves) and Hugging Face checkpoint directories
//! (`model.safetensors`, or shards listed in `model.safetensors.index.json`),
//! found by path or by repo id in the Hugging Face cache (`hub`), and GGUF
//! files, llama.cpp's format (`gguf`).

pub mod gguf;
mod hf;
pub mod hub;
pub mod quant;
mod safetensors;

pub use self::hf::{
    load_checkpoint_dir, save_checkpoint_dir, save_checkpoint_files, split_by_size, INDEX_FILE, SINGLE_FILE,
};
pub use self::quant::{load_quantized, QuantMethod, QuantizationConfig, QuantizedCheckpoint, QuantizedWeight};
pub use self::safetensors::{load_safetensors, save_safetensors, write_atomic, SafetensorsFile};
