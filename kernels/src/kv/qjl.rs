//! QJL 1-bit key sketches (placeholder until the codec lands).
use super::{CodecOptions, KvGeometry};
/// QJL codec.
pub struct QjlCodec;
impl QjlCodec {
    /// Not yet implemented.
    pub fn new(_g: KvGeometry, _o: CodecOptions) -> super::plain::F32Codec {
        unimplemented!("qjl1")
    }
}
