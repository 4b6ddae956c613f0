//! `NcclComm` on one GPU (world size 1, the only group a single-GPU machine can form): every
//! collective must leave the data exactly as it was (a sum, gather or broadcast over one rank),
//! tolerance 0. Skips, saying so, without a GPU or without libnccl; with `TESSERA_REQUIRE_NCCL`
//! set, a missing libnccl fails instead (`TESSERA_REQUIRE_GPU` alone does not require it: the
//! GPU check's CUDA wheels carry NVRTC and cuBLAS, not NCCL).

use crate::common::{randn, rng};
use tessera_kernels::comm::NcclComm;
use tessera_kernels::cuda::test_device;

#[test]
fn nccl_world_one_collectives_are_exact() {
    let Some(dev) = test_device() else { return };
    if !NcclComm::available() {
        if std::env::var_os("TESSERA_REQUIRE_NCCL").is_some() {
            panic!("TESSERA_REQUIRE_NCCL is set but libnccl is not loadable");
        }
        eprintln!("skipped: libnccl is not loadable");
        return;
    }
    let mut r = rng(24);
    let x = randn(&mut r, 4099);
    let download = |s: &cudarc::driver::CudaSlice<f32>| {
        dev.synchronize().unwrap();
        dev.stream().clone_dtoh(s).unwrap()
    };

    let comms = NcclComm::group_single_process(std::slice::from_ref(&dev)).unwrap();
    let [c] = &comms[..] else { panic!("expected one communicator") };
    assert_eq!((c.rank(), c.world()), (0, 1));
    let mut buf = dev.stream().clone_htod(&x).unwrap();
    c.all_reduce_sum(&mut buf).unwrap();
    assert_eq!(download(&buf), x, "all_reduce_sum over one rank");
    let mut out = dev.stream().clone_htod(&vec![f32::NAN; x.len()]).unwrap();
    c.all_gather(&buf, &mut out).unwrap();
    assert_eq!(download(&out), x, "all_gather over one rank");
    c.broadcast(&mut buf, 0).unwrap();
    assert_eq!(download(&buf), x, "broadcast over one rank");
    assert!(c.all_gather(&buf, &mut dev.stream().clone_htod(&x[..5]).unwrap()).is_err());
    let s = c.stats();
    assert_eq!((s.calls, s.bytes), (3, 3 * 4 * x.len() as u64));

    // The per-thread constructor, as rank threads will use it.
    let id = NcclComm::new_id().unwrap();
    let solo = NcclComm::from_id(&dev, 0, 1, id).unwrap();
    let mut buf = dev.stream().clone_htod(&x).unwrap();
    solo.all_reduce_sum(&mut buf).unwrap();
    assert_eq!(download(&buf), x, "all_reduce_sum through from_id");
}
