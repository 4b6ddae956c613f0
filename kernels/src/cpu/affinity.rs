//! CPU sets for tensor-parallel ranks: parsing a binding spec, splitting the machine's CPUs
//! among ranks, and pinning threads.
//!
//! A spec is vLLM's and SGLang's syntax, `"0-31|32-63"`: one CPU list per rank, separated by
//! `|`, each a comma list of CPUs and inclusive ranges (`0-3,8,10-11`), the same list format the
//! kernel writes to sysfs `cpulist` files. Without a spec, [`auto_cpu_split`] gives each rank a
//! NUMA node (or a contiguous group of nodes) when there are enough nodes, and otherwise an
//! as-even-as-possible contiguous share of the CPUs this process may run on.
//!
//! Pinning ([`pin_current_thread`]) uses `sched_setaffinity` on Linux and does nothing
//! elsewhere.

use std::collections::BTreeSet;
use std::io;

/// Parses a CPU list such as `0-3,8,10-11` (the format of sysfs `cpulist` files and of one rank
/// of a binding spec) into CPU numbers in the order written. Surrounding whitespace, including
/// sysfs's trailing newline, is ignored; an empty list (a memory-only NUMA node) is `Ok(vec![])`.
pub fn parse_cpu_list(list: &str) -> Result<Vec<usize>, String> {
    let list = list.trim();
    if list.is_empty() {
        return Ok(Vec::new());
    }
    let mut cpus = Vec::new();
    let mut seen = BTreeSet::new();
    for item in list.split(',') {
        let item = item.trim();
        let number = |s: &str| {
            s.trim().parse::<usize>().map_err(|_| format!("`{item}` is not a CPU number or a range like 4-7"))
        };
        let (lo, hi) = match item.split_once('-') {
            Some((a, b)) => (number(a)?, number(b)?),
            None => {
                let c = number(item)?;
                (c, c)
            }
        };
        if lo > hi {
            return Err(format!("range `{item}` runs backwards"));
        }
        for c in lo..=hi {
            if !seen.insert(c) {
                return Err(format!("CPU {c} is listed twice"));
            }
            cpus.push(c);
        }
    }
    Ok(cpus)
}

/// Parses a binding spec, `"0-31|32-63"`, into one CPU list per rank. Errors name the faulty
/// rank: an empty rank, a malformed or backwards range, or a CPU given twice (within a rank or
/// across ranks).
pub fn parse_cpu_bind(spec: &str) -> Result<Vec<Vec<usize>>, String> {
    let mut owner: std::collections::BTreeMap<usize, usize> = Default::default();
    let mut ranks = Vec::new();
    for (rank, list) in spec.split('|').enumerate() {
        let cpus = parse_cpu_list(list).map_err(|e| format!("CPU binding `{spec}`, rank {rank}: {e}"))?;
        if cpus.is_empty() {
            return Err(format!("CPU binding `{spec}`: rank {rank} has no CPUs"));
        }
        for &c in &cpus {
            if let Some(other) = owner.insert(c, rank) {
                return Err(format!("CPU binding `{spec}`: CPU {c} is given to both rank {other} and rank {rank}"));
            }
        }
        ranks.push(cpus);
    }
    Ok(ranks)
}

/// How [`auto_cpu_split`] divided the CPUs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CpuSplit {
    /// One CPU list per rank. Within a rank, the first hardware thread of every core comes
    /// before any second one, so a pool with one thread per core pins to distinct cores.
    pub ranks: Vec<Vec<usize>>,
    /// Each rank got whole NUMA nodes.
    pub by_numa_node: bool,
    /// There were fewer CPUs than ranks, so ranks share CPUs round-robin (rank `r` runs on the
    /// CPU `r mod cpus`). Worth a warning from the caller: ranks will contend for cores.
    pub shared: bool,
}

/// Splits the CPUs this process may run on among `world` ranks (`world` of 0 is taken as 1).
///
/// With at least `world` NUMA nodes that have allowed CPUs (and more than one), rank `r` gets
/// the `r`-th contiguous, as-even-as-possible group of nodes: 4 nodes over 2 ranks give nodes
/// {0,1} and {2,3}, so a rank's memory traffic stays on its own nodes. Otherwise the allowed
/// CPUs, grouped into physical cores (SMT siblings together), are split into `world` contiguous
/// groups whose sizes differ by at most one core; with fewer cores than ranks, single CPUs are
/// split instead; with fewer CPUs than ranks, ranks share CPUs (see [`CpuSplit::shared`]).
/// Allowed CPUs come from the calling thread's affinity mask, so call this before pinning it.
pub fn auto_cpu_split(world: usize) -> CpuSplit {
    let allowed = allowed_cpus();
    let nodes = numa_nodes(&allowed);
    split_cpus(world.max(1), &allowed, &nodes, &sysfs_siblings)
}

/// [`auto_cpu_split`] over given CPUs, NUMA nodes and SMT sibling lookup.
fn split_cpus(
    world: usize,
    allowed: &[usize],
    nodes: &[Vec<usize>],
    siblings: &dyn Fn(usize) -> Option<Vec<usize>>,
) -> CpuSplit {
    if nodes.len() >= world.max(2) {
        let (groups, _) = split_contiguous(nodes, world);
        let ranks = groups.iter().map(|g| interleave(&group_cores(&g.concat(), siblings))).collect();
        return CpuSplit { ranks, by_numa_node: true, shared: false };
    }
    let cores = group_cores(allowed, siblings);
    let units = if cores.len() >= world { cores } else { cores.concat().into_iter().map(|c| vec![c]).collect() };
    let (groups, shared) = split_contiguous(&units, world);
    let ranks = groups.iter().map(|g| interleave(g)).collect();
    CpuSplit { ranks, by_numa_node: false, shared }
}

/// Splits `units` into `world` contiguous groups whose sizes differ by at most one; with fewer
/// units than ranks, rank `r` gets unit `r mod len` alone and the flag is set.
fn split_contiguous<T: Clone>(units: &[T], world: usize) -> (Vec<Vec<T>>, bool) {
    let n = units.len();
    if n < world {
        return ((0..world).map(|r| vec![units[r % n].clone()]).collect(), true);
    }
    ((0..world).map(|r| units[r * n / world..(r + 1) * n / world].to_vec()).collect(), false)
}

/// Groups `cpus` into cores: each CPU with those of its SMT siblings that are also in `cpus`,
/// ordered by the first CPU of each core. A CPU whose siblings are unknown is a core alone.
fn group_cores(cpus: &[usize], siblings: &dyn Fn(usize) -> Option<Vec<usize>>) -> Vec<Vec<usize>> {
    let wanted: BTreeSet<usize> = cpus.iter().copied().collect();
    let mut placed = BTreeSet::new();
    let mut cores = Vec::new();
    for &c in &wanted {
        if placed.contains(&c) {
            continue;
        }
        let mut core: Vec<usize> = siblings(c).unwrap_or_default().into_iter().filter(|s| wanted.contains(s)).collect();
        if !core.contains(&c) {
            core.push(c);
        }
        core.sort_unstable();
        core.retain(|s| placed.insert(*s));
        cores.push(core);
    }
    cores
}

/// Flattens cores so that the first thread of every core comes first, then the second ones, ...
fn interleave(cores: &[Vec<usize>]) -> Vec<usize> {
    let depth = cores.iter().map(Vec::len).max().unwrap_or(0);
    (0..depth).flat_map(|t| cores.iter().filter_map(move |core| core.get(t).copied())).collect()
}

/// The CPUs of each NUMA node in node order, restricted to `allowed`, nodes left empty dropped.
fn numa_nodes(allowed: &[usize]) -> Vec<Vec<usize>> {
    let Ok(dir) = std::fs::read_dir("/sys/devices/system/node") else { return Vec::new() };
    let mut nodes: Vec<(usize, Vec<usize>)> = dir
        .filter_map(|e| {
            let e = e.ok()?;
            let id = e.file_name().to_str()?.strip_prefix("node")?.parse().ok()?;
            let list = std::fs::read_to_string(e.path().join("cpulist")).ok()?;
            Some((id, parse_cpu_list(&list).ok()?))
        })
        .collect();
    nodes.sort_unstable_by_key(|(id, _)| *id);
    nodes
        .into_iter()
        .map(|(_, cpus)| cpus.into_iter().filter(|c| allowed.contains(c)).collect::<Vec<_>>())
        .filter(|cpus| !cpus.is_empty())
        .collect()
}

/// A CPU's SMT siblings (itself included) from sysfs.
fn sysfs_siblings(cpu: usize) -> Option<Vec<usize>> {
    let path = format!("/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list");
    parse_cpu_list(&std::fs::read_to_string(path).ok()?).ok()
}

/// The CPUs the calling thread may run on, ascending: its affinity mask, or where that cannot
/// be read, `0..available_parallelism`.
pub fn allowed_cpus() -> Vec<usize> {
    match current_thread_cpus() {
        Ok(cpus) if !cpus.is_empty() => cpus,
        _ => (0..std::thread::available_parallelism().map_or(1, |n| n.get())).collect(),
    }
}

/// Restricts the calling thread to `cpus` (Linux `sched_setaffinity`; elsewhere a no-op that
/// succeeds). Fails for an empty set, a CPU past the kernel mask size, or a set the process may
/// not use.
pub fn pin_current_thread(cpus: &[usize]) -> io::Result<()> {
    if cpus.is_empty() {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "cannot pin a thread to no CPUs"));
    }
    #[cfg(target_os = "linux")]
    {
        // SAFETY: a zeroed cpu_set_t is the empty set.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        for &c in cpus {
            if c >= libc::CPU_SETSIZE as usize {
                return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("CPU {c} is beyond the affinity mask")));
            }
            // SAFETY: `c` is below CPU_SETSIZE, the set's capacity.
            unsafe { libc::CPU_SET(c, &mut set) };
        }
        // SAFETY: pid 0 is the calling thread; the size is that of the set passed.
        let r = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// The CPUs the calling thread may run on (Linux `sched_getaffinity`), ascending; `Unsupported`
/// on other targets.
pub fn current_thread_cpus() -> io::Result<Vec<usize>> {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: a zeroed cpu_set_t is a valid set for the kernel to fill.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        // SAFETY: pid 0 is the calling thread; the size is that of the set passed.
        let r = unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: every index is below CPU_SETSIZE, the set's capacity.
        Ok((0..libc::CPU_SETSIZE as usize).filter(|&c| unsafe { libc::CPU_ISSET(c, &set) }).collect())
    }
    #[cfg(not(target_os = "linux"))]
    Err(io::Error::new(io::ErrorKind::Unsupported, "thread affinity is only read on Linux"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_parse_like_sysfs() {
        assert_eq!(parse_cpu_list("0-3,8,10-11\n"), Ok(vec![0, 1, 2, 3, 8, 10, 11]));
        assert_eq!(parse_cpu_list("5"), Ok(vec![5]));
        assert_eq!(parse_cpu_list(" 2 - 3 , 0 "), Ok(vec![2, 3, 0]));
        // A memory-only NUMA node has an empty cpulist.
        assert_eq!(parse_cpu_list("\n"), Ok(vec![]));
        assert!(parse_cpu_list("0-").is_err());
        assert!(parse_cpu_list("a").is_err());
        assert!(parse_cpu_list("1,,2").is_err());
        assert!(parse_cpu_list("0-1-2").is_err());
        assert!(parse_cpu_list("-1").is_err());
    }

    #[test]
    fn bind_specs_give_one_list_per_rank() {
        assert_eq!(parse_cpu_bind("0-3|4-7"), Ok(vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]]));
        assert_eq!(parse_cpu_bind("0-1,8|2,9-10|3"), Ok(vec![vec![0, 1, 8], vec![2, 9, 10], vec![3]]));
        assert_eq!(parse_cpu_bind("7"), Ok(vec![vec![7]]));
    }

    #[test]
    fn bad_bind_specs_say_what_is_wrong() {
        let err = |spec: &str| parse_cpu_bind(spec).expect_err(spec);
        assert!(err("0-3|").contains("rank 1 has no CPUs"), "{}", err("0-3|"));
        assert!(err("|0-3").contains("rank 0 has no CPUs"));
        assert!(err("").contains("rank 0 has no CPUs"));
        assert!(err("0-3|7-4").contains("runs backwards"));
        assert!(err("0-3|4-x").contains("rank 1"));
        assert!(err("0-3|3-5").contains("CPU 3 is given to both rank 0 and rank 1"));
        assert!(err("0-3,2").contains("CPU 2 is listed twice"));
    }

    fn no_smt(_: usize) -> Option<Vec<usize>> {
        None
    }

    #[test]
    fn cpus_split_evenly_and_contiguously() {
        let s = split_cpus(2, &[0, 1, 2, 3], &[], &no_smt);
        assert_eq!(s, CpuSplit { ranks: vec![vec![0, 1], vec![2, 3]], by_numa_node: false, shared: false });
        let s = split_cpus(3, &(0..8).collect::<Vec<_>>(), &[], &no_smt);
        assert_eq!(s.ranks, vec![vec![0, 1], vec![2, 3, 4], vec![5, 6, 7]]);
        let s = split_cpus(1, &[4, 5], &[], &no_smt);
        assert_eq!(s.ranks, vec![vec![4, 5]]);
    }

    #[test]
    fn fewer_cpus_than_ranks_share_round_robin() {
        let s = split_cpus(3, &[2, 5], &[], &no_smt);
        assert_eq!(s, CpuSplit { ranks: vec![vec![2], vec![5], vec![2]], by_numa_node: false, shared: true });
    }

    #[test]
    fn smt_siblings_stay_in_one_rank_with_first_threads_first() {
        // 4 cores, CPU c and c + 4 are siblings (the usual x86 numbering).
        let smt = |c: usize| Some(vec![c % 4, c % 4 + 4]);
        let s = split_cpus(2, &(0..8).collect::<Vec<_>>(), &[], &smt);
        assert_eq!(s.ranks, vec![vec![0, 1, 4, 5], vec![2, 3, 6, 7]]);
        // Fewer cores than ranks: single CPUs are split, siblings adjacent.
        let s = split_cpus(4, &[0, 1, 4, 5], &[], &smt);
        assert_eq!(s.ranks, vec![vec![0], vec![4], vec![1], vec![5]]);
        assert!(!s.shared);
    }

    #[test]
    fn numa_nodes_go_whole_to_ranks() {
        let nodes = [vec![0, 1], vec![2, 3], vec![4, 5], vec![6, 7]];
        let all: Vec<usize> = (0..8).collect();
        let s = split_cpus(2, &all, &nodes, &no_smt);
        assert_eq!(s, CpuSplit { ranks: vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]], by_numa_node: true, shared: false });
        let s = split_cpus(4, &all, &nodes, &no_smt);
        assert_eq!(s.ranks, vec![vec![0, 1], vec![2, 3], vec![4, 5], vec![6, 7]]);
        // Fewer nodes than ranks: split by CPU instead.
        let s = split_cpus(8, &all, &nodes, &no_smt);
        assert!(!s.by_numa_node);
        assert_eq!(s.ranks.len(), 8);
        // One node: split by CPU.
        let s = split_cpus(1, &all, &nodes[..1], &no_smt);
        assert!(!s.by_numa_node);
    }

    #[test]
    fn the_real_machine_splits_into_allowed_cpus() {
        let allowed = allowed_cpus();
        assert!(!allowed.is_empty());
        for world in 1..=3 {
            let s = auto_cpu_split(world);
            assert_eq!(s.ranks.len(), world);
            assert!(s.ranks.iter().flatten().all(|c| allowed.contains(c)), "{s:?} vs {allowed:?}");
            assert!(s.ranks.iter().all(|r| !r.is_empty()));
            assert_eq!(s.shared, allowed.len() < world);
        }
    }
}
