//! Fuzzing the envelope decoder (proptest; bounded for CI by `CHIME_FUZZ_CASES`, default 3,000
//! per property). Whatever bytes arrive, decoding never panics, and every input is either a
//! valid envelope — one that keeps every invariant the worker relies on — or `malformed`.

use super::*;
use proptest::prelude::*;
use proptest::test_runner::Config;

fn cases() -> u32 {
    crate::fuzz_cases(3_000)
}

/// What a decoded envelope must satisfy, or the worker would misbehave on it.
fn check_valid(env: &Envelope) -> Result<(), TestCaseError> {
    prop_assert_eq!(env.v, VERSION);
    prop_assert!(env.attempt >= 1 && env.attempt <= env.max_attempts && env.max_attempts <= MAX_ATTEMPTS);
    prop_assert!(chime_job::valid_name(&env.job) && chime_job::valid_name(&env.queue));
    // A handler sees a shard only of a run that has it.
    match (env.shard, env.shards) {
        (None, None) => {}
        (Some(s), Some(n)) => prop_assert!(n >= 1 && s < n && n <= super::MAX_SHARDS),
        other => prop_assert!(false, "half a shard: {:?}", other),
    }
    // Re-encoding gives back the same envelope (what a retry publishes), within the length
    // bound that spares a producer counting it.
    let body = env.encode();
    prop_assert!(env.len_bound().is_none_or(|b| b >= body.len()), "bound below {}", body.len());
    let again = Envelope::decode(&body);
    prop_assert!(again.as_ref().is_ok_and(|a| a == env), "re-encoding changed it: {:?}", again);
    Ok(())
}

fn decode_checked(bytes: &[u8]) -> Result<(), TestCaseError> {
    match Envelope::decode(bytes) {
        Ok(env) => check_valid(&env),
        Err(e) => {
            // The reason is shown in logs and headers: one line, no raw control characters.
            let text = e.to_string();
            prop_assert!(
                !text.contains('\n') && !text.chars().any(|c| c.is_control() && c != '\t'),
                "{}",
                text
            );
            Ok(())
        }
    }
}

fn json_leaf() -> impl Strategy<Value = serde_json::Value> {
    prop_oneof![
        Just(serde_json::Value::Null),
        any::<bool>().prop_map(serde_json::Value::from),
        any::<i64>().prop_map(serde_json::Value::from),
        any::<u64>().prop_map(serde_json::Value::from),
        any::<f64>().prop_filter("finite", |f| f.is_finite()).prop_map(serde_json::Value::from),
        ".{0,40}".prop_map(serde_json::Value::from),
        Just(serde_json::Value::from(u32::MAX)),
        (0u32..4).prop_map(serde_json::Value::from),
        Just(serde_json::Value::from("")),
        Just(serde_json::Value::from("de\u{0}fault")),
        Just(serde_json::Value::from("a\nINFO forged")),
    ]
}

fn json_value() -> impl Strategy<Value = serde_json::Value> {
    json_leaf().prop_recursive(4, 32, 6, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..6).prop_map(serde_json::Value::Array),
            proptest::collection::btree_map(".{0,8}", inner, 0..6)
                .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
        ]
    })
}

const FIELDS: [&str; 18] = [
    "v",
    "id",
    "key",
    "job",
    "queue",
    "payload",
    "slot",
    "enqueued_at",
    "attempt",
    "max_attempts",
    "source",
    "trace_id",
    "shard",
    "shards",
    "group",
    "priority",
    "target",
    "extra_field",
];

#[derive(Debug, Clone)]
enum Mutation {
    Remove(usize),
    Replace(usize, serde_json::Value),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (0..FIELDS.len()).prop_map(Mutation::Remove),
        ((0..FIELDS.len()), json_value()).prop_map(|(i, v)| Mutation::Replace(i, v)),
    ]
}

fn valid() -> serde_json::Value {
    let env = Envelope::new(
        "job",
        "default",
        adhoc_key("job", "k"),
        serde_json::json!({"a": [1, 2]}),
        None,
        5,
        Source::Adhoc,
    );
    serde_json::from_slice(&env.encode()).unwrap_or_default()
}

proptest! {
    #![proptest_config(Config { cases: cases(), failure_persistence: None, ..Config::default() })]

    #[test]
    fn arbitrary_bytes_are_an_envelope_or_malformed(bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
        decode_checked(&bytes)?;
    }

    #[test]
    fn mutated_envelopes_are_valid_or_malformed(mutations in proptest::collection::vec(mutation(), 1..5)) {
        let mut v = valid();
        for m in mutations {
            match (m, v.as_object_mut()) {
                (Mutation::Remove(i), Some(o)) => { o.remove(FIELDS[i]); }
                (Mutation::Replace(i, value), Some(o)) => { o.insert(FIELDS[i].to_string(), value); }
                _ => {}
            }
        }
        decode_checked(&serde_json::to_vec(&v).unwrap_or_default())?;
    }

    #[test]
    fn corrupted_bytes_of_a_valid_envelope_are_valid_or_malformed(
        edits in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8),
        cut in any::<usize>(),
    ) {
        let mut bytes = serde_json::to_vec(&valid()).unwrap_or_default();
        for (at, b) in edits {
            let i = at % bytes.len();
            bytes[i] = b;
        }
        bytes.truncate(cut % (bytes.len() + 1) + bytes.len() / 2);
        decode_checked(&bytes)?;
    }
}

#[test]
fn deep_nesting_is_malformed_not_a_stack_overflow() {
    let depth = 30_000;
    let body = format!("{}{}{}", "[".repeat(depth), "1", "]".repeat(depth));
    assert!(Envelope::decode(body.as_bytes()).is_err());
    let mut v = valid();
    v["payload"] = serde_json::Value::Null;
    let text = serde_json::to_string(&v)
        .unwrap()
        .replace("\"payload\":null", &format!("\"payload\":{}1{}", "[".repeat(depth), "]".repeat(depth)));
    assert!(Envelope::decode(text.as_bytes()).is_err());
}
