//! HQMQ (placeholder until the codec lands).
use super::{CodecOptions, HqmqParams, KvGeometry, KvRole};
/// HQMQ codec.
pub struct HqmqCodec;
impl HqmqCodec {
    /// Not yet implemented.
    pub fn new(_g: KvGeometry, _p: HqmqParams, _r: KvRole, _o: CodecOptions) -> super::plain::F32Codec {
        unimplemented!("hqmq")
    }
}
