//! arbor's model layer: HF configs and safetensors, sharded linear layers, the decoder
//! forward written once against `backend::Backend`, KV cache and seeded sampling.

pub mod backend;
