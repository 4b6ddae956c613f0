//! TQ3_0 (placeholder until the codec lands).
use super::KvGeometry;
/// TQ3_0 codec.
pub struct Tq3Codec;
impl Tq3Codec {
    /// Not yet implemented.
    pub fn new(_g: KvGeometry) -> super::plain::F32Codec {
        unimplemented!("tq3_0")
    }
}
