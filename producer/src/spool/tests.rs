use super::*;
use chime_shared::envelope::{Source, adhoc_key};

/// A fresh directory under the system's temp dir (removed by the test).
fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("chime-spool-{name}-{}", uuid::Uuid::new_v4().simple()));
    fs::create_dir_all(&d).unwrap();
    d
}

fn job(i: usize) -> Spooled {
    Spooled {
        envelope: Envelope::new(
            "mail",
            "default",
            adhoc_key("mail", &format!("k{i}")),
            serde_json::json!({"i": i}),
            None,
            3,
            Source::Adhoc,
        ),
        deliver_at: None,
        declare_queue: None,
        spooled_at: Utc::now(),
        reason: "connection refused".into(),
    }
}

fn only_file(d: &Path) -> PathBuf {
    let files: Vec<PathBuf> = fs::read_dir(d)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().ends_with(LOG))
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    files[0].clone()
}

#[test]
fn records_come_back_in_order_and_go_once_published() {
    let d = dir("order");
    let spool = Spool::open(&d, 1 << 20, "t").unwrap();
    let jobs: Vec<Spooled> = (0..5).map(job).collect();
    spool.append(&jobs[..2]).unwrap();
    spool.append(&jobs[2..]).unwrap();
    assert_eq!(spool.list().unwrap(), jobs);
    let status = spool.status().unwrap();
    assert_eq!((status.files, status.records), (1, 5));
    assert!(status.bytes > 0 && status.oldest == Some(jobs[0].spooled_at), "{status:?}");

    let claimed = spool.claim().unwrap();
    assert_eq!(claimed.len(), 1);
    assert_eq!(claimed[0].records, jobs);
    // Appends after the claim go to a new file, never into the one being flushed.
    spool.append(&[job(5)]).unwrap();
    // Two published, then the flusher is cut off: the rest come back, not those two.
    claimed[0].published(2).unwrap();
    drop(claimed);
    let again = spool.claim().unwrap();
    let keys: Vec<_> = again.iter().flat_map(|c| c.records.iter().map(|r| r.envelope.key)).collect();
    let want: Vec<_> = (2..6).map(|i| job(i).envelope.key).collect();
    assert_eq!(keys, want);
    for c in again {
        c.finish().unwrap();
    }
    assert_eq!(spool.status().unwrap(), SpoolStatus::default());
    let left: Vec<_> = fs::read_dir(&d).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(left, [".prefix"], "nothing left behind but the owner's name");
    fs::remove_dir_all(&d).unwrap();
}

#[test]
fn a_file_another_producer_holds_is_left_to_it() {
    let d = dir("shared");
    let (a, b) = (Spool::open(&d, 1 << 20, "t").unwrap(), Spool::open(&d, 1 << 20, "t").unwrap());
    a.append(&[job(1)]).unwrap();
    b.append(&[job(2)]).unwrap();
    // Each takes its own file only: the other's is locked by its owner.
    let (ca, cb) = (a.claim().unwrap(), b.claim().unwrap());
    assert_eq!(ca.len(), 1);
    assert_eq!(cb.len(), 1);
    assert_eq!(ca[0].records[0].envelope.key, job(1).envelope.key);
    assert_eq!(cb[0].records[0].envelope.key, job(2).envelope.key);
    // Both listed by either, meanwhile.
    assert_eq!(a.list().unwrap().len(), 2);
    drop(cb); // b's flusher dies with its file taken: a may take it now
    let later = a.claim().unwrap();
    assert_eq!(later.len(), 1);
    assert_eq!(later[0].records[0].envelope.key, job(2).envelope.key);
    fs::remove_dir_all(&d).unwrap();
}

#[test]
fn a_torn_tail_is_set_aside_and_the_whole_records_before_it_flush() {
    let d = dir("torn");
    let spool = Spool::open(&d, 1 << 20, "t").unwrap();
    spool.append(&[job(1), job(2)]).unwrap();
    let path = only_file(&d);
    drop(spool); // the producer dies...
    // ...in the middle of its third record: half a line, no newline.
    let third = line(&job(3)).unwrap();
    let mut f = OpenOptions::new().append(true).open(&path).unwrap();
    f.write_all(&third[..third.len() / 2]).unwrap();
    drop(f);

    let next = Spool::open(&d, 1 << 20, "t").unwrap();
    assert_eq!(next.list().unwrap().len(), 2, "the torn line is not a record");
    let claimed = next.claim().unwrap();
    assert_eq!(claimed.len(), 1);
    let keys: Vec<_> = claimed[0].records.iter().map(|r| r.envelope.key).collect();
    assert_eq!(keys, vec![job(1).envelope.key, job(2).envelope.key]);
    let (aside, why) = claimed[0].torn.clone().unwrap();
    assert!(why.contains("line 3") && why.contains("newline"), "{why}");
    let kept = fs::read(&aside).unwrap();
    assert_eq!(&kept[..kept.len() - 1], &third[..third.len() / 2], "the torn bytes are kept as they were");
    drop(claimed);
    // Read again (a flush retried): set aside once, not twice.
    let again = next.claim().unwrap();
    assert_eq!(fs::read(&aside).unwrap(), kept);
    for c in again {
        c.finish().unwrap();
    }
    assert_eq!(next.status().unwrap().torn, vec![aside]);
    fs::remove_dir_all(&d).unwrap();
}

#[test]
fn a_damaged_line_is_skipped_by_its_number_and_the_rest_flush() {
    let d = dir("damaged");
    let spool = Spool::open(&d, 1 << 20, "t").unwrap();
    spool.append(&[job(1), job(2), job(3)]).unwrap();
    let path = only_file(&d);
    drop(spool);
    // One byte of the second record flipped on disk.
    let mut bytes = fs::read(&path).unwrap();
    let second = bytes.iter().position(|b| *b == b'\n').unwrap() + 30;
    bytes[second] ^= 0x20;
    fs::write(&path, &bytes).unwrap();
    let claimed = Spool::open(&d, 1 << 20, "t").unwrap().claim().unwrap();
    let keys: Vec<_> = claimed[0].records.iter().map(|r| r.envelope.key).collect();
    assert_eq!(keys, vec![job(1).envelope.key, job(3).envelope.key]);
    let why = &claimed[0].torn.as_ref().unwrap().1;
    assert!(why.contains("line 2: checksum does not match"), "{why}");
    fs::remove_dir_all(&d).unwrap();
}

#[test]
fn a_producer_starts_a_new_file_past_its_size_and_flushes_file_by_file() {
    let d = dir("rotate");
    let mut spool = Spool::open(&d, 1 << 20, "t").unwrap();
    let one = line(&job(0)).unwrap().len() as u64;
    spool.file_bytes = one * 3 + 1; // three records a file
    let jobs: Vec<Spooled> = (0..8).map(job).collect();
    for j in &jobs {
        spool.append(std::slice::from_ref(j)).unwrap();
    }
    assert_eq!(spool.status().unwrap().files, 3);
    // Taken one file at a time, in order; each holds at most three records.
    let first = spool.claim_next().unwrap().unwrap();
    let second = spool.claim_next().unwrap().unwrap();
    let third = spool.claim_next().unwrap().unwrap();
    assert!(spool.claim_next().unwrap().is_none(), "all three are held");
    let keys: Vec<_> =
        [&first, &second, &third].iter().flat_map(|c| c.records.iter().map(|r| r.envelope.key)).collect();
    assert_eq!(keys, jobs.iter().map(|j| j.envelope.key).collect::<Vec<_>>());
    assert!([&first, &second, &third].iter().all(|c| c.records.len() <= 3));
    fs::remove_dir_all(&d).unwrap();
}

#[test]
fn a_full_spool_refuses_the_whole_batch_by_name() {
    let d = dir("full");
    let one = line(&job(1)).unwrap().len() as u64;
    let spool = Spool::open(&d, one * 2 + 10, "t").unwrap();
    spool.append(&[job(1)]).unwrap();
    let err = spool.append(&[job(2), job(3)]).unwrap_err();
    assert!(matches!(err, SpoolError::Full { .. }), "{err:?}");
    assert!(err.to_string().contains("producer.spool_max_bytes"), "{err}");
    assert_eq!(spool.list().unwrap().len(), 1, "none of the batch taken");
    spool.append(&[job(2)]).unwrap();
    assert_eq!(spool.list().unwrap().len(), 2);
    fs::remove_dir_all(&d).unwrap();
}

#[test]
fn a_record_round_trips_and_unknown_fields_are_refused() {
    let mut j = job(7);
    j.deliver_at = Some(Utc::now());
    j.declare_queue = Some("typed".into());
    let l = line(&j).unwrap();
    assert_eq!(parse(&l[..l.len() - 1]).unwrap(), j);
    let json = br#"{"envelope":null,"extra":1}"#;
    let mut forged = format!("{:016x} ", checksum(json)).into_bytes();
    forged.extend_from_slice(json);
    assert!(parse(&forged).unwrap_err().starts_with("not a spooled job"));
    assert!(parse(b"short").unwrap_err().contains("too short"));
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]
    /// A producer killed at any byte of its writes: the next flush gets exactly the records
    /// whose line was whole, in order, and sets aside the rest (if any), never garbage.
    #[test]
    fn a_write_cut_at_any_byte_leaves_the_whole_records_before_it(n in 1usize..12, cut in 0.0f64..=1.0) {
        let d = dir("cut");
        let jobs: Vec<Spooled> = (0..n).map(job).collect();
        let lines: Vec<Vec<u8>> = jobs.iter().map(|j| line(j).unwrap()).collect();
        let all: Vec<u8> = lines.concat();
        let at = ((all.len() as f64) * cut) as usize;
        let path = d.join(format!("{PREFIX}{:020}-1-x{LOG}", 1));
        fs::write(&path, &all[..at]).unwrap();
        let mut whole = 0;
        let mut end = 0;
        // Lines differ in length (a timestamp's digits vary), so count up to the first that
        // does not fit: a shorter one after it is not whole on disk.
        for l in &lines {
            if end + l.len() > at {
                break;
            }
            end += l.len();
            whole += 1;
        }
        let claimed = Spool::open(&d, u64::MAX, "t").unwrap().claim().unwrap();
        let got: Vec<_> = claimed.iter().flat_map(|c| c.records.iter().map(|r| r.envelope.key)).collect();
        let want: Vec<_> = jobs[..whole].iter().map(|j| j.envelope.key).collect();
        proptest::prop_assert_eq!(got, want);
        proptest::prop_assert_eq!(claimed[0].torn.is_some(), at > end, "torn iff cut inside a line");
        drop(claimed);
        fs::remove_dir_all(&d).unwrap();
    }
}

#[test]
fn a_directory_is_made_at_the_first_append_and_belongs_to_one_prefix() {
    let d = dir("prefix").join("spool");
    let spool = Spool::open(&d, 1 << 20, "app-a").unwrap();
    // Opening, reading and claiming an empty spool leave no directory behind.
    assert_eq!(spool.status().unwrap().records, 0);
    assert!(spool.claim().unwrap().is_empty());
    assert!(!d.exists(), "the directory is made at the first append only");
    spool.append(&[job(0)]).unwrap();
    assert_eq!(fs::read_to_string(d.join(".prefix")).unwrap(), "app-a\n");
    // Another prefix's process is refused, naming both: it would publish app-a's jobs into
    // its own queues.
    let err = Spool::open(&d, 1 << 20, "app-b").err().expect("another prefix is refused").to_string();
    assert!(err.contains("\"app-a\"") && err.contains("\"app-b\"") && err.contains("spool_dir"), "{err}");
    let keys: Vec<_> =
        Spool::open(&d, 1 << 20, "app-a").unwrap().list().unwrap().iter().map(|r| r.envelope.key).collect();
    assert_eq!(keys, [job(0).envelope.key]);
    fs::remove_dir_all(d.parent().unwrap()).unwrap();
}
