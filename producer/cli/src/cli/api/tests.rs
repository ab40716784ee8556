use super::*;

fn doc() -> serde_json::Value {
    serde_json::from_str(OPENAPI).expect("openapi.json is JSON")
}

/// The property names of schema `name` in the OpenAPI document.
fn schema_fields<'a>(doc: &'a serde_json::Value, name: &str) -> BTreeSet<&'a str> {
    doc["components"]["schemas"][name]["properties"].as_object().unwrap().keys().map(String::as_str).collect()
}

#[test]
fn the_openapi_document_lists_the_routes_and_the_body_fields_the_code_has() {
    let doc = doc();
    let paths: BTreeSet<&str> = doc["paths"].as_object().unwrap().keys().map(String::as_str).collect();
    assert_eq!(paths, ROUTES.into_iter().collect(), "routes in openapi.json and in the router differ");
    let props: BTreeSet<&str> = schema_fields(&doc, "JobRequest");
    assert_eq!(
        props,
        body::FIELDS.into_iter().collect(),
        "JobRequest properties and the body's fields differ"
    );
    // The body refuses what it does not know, and its own list of fields is the one above.
    let (field, message) = body::request("j", br#"{"nope": 1}"#).unwrap_err();
    assert_eq!(field.as_deref(), Some("nope"));
    for f in body::FIELDS {
        assert!(message.contains(&format!("`{f}`")), "{f} missing from {message}");
    }
    // The answer's fields are those an `Enqueued` serialises to.
    let enqueued = chime_producer::Enqueued {
        id: uuid::Uuid::nil(),
        key: uuid::Uuid::nil(),
        job: "j".into(),
        queue: "q".into(),
        members: vec![uuid::Uuid::nil()],
        delivery: chime_producer::Delivery::Spooled,
    };
    let v = serde_json::to_value(&enqueued).unwrap();
    let fields: BTreeSet<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
    let documented: BTreeSet<&str> = schema_fields(&doc, "Enqueued");
    assert_eq!(fields, documented);
}

#[test]
fn every_status_the_enqueue_route_answers_is_documented() {
    let doc = doc();
    let documented: BTreeSet<String> = doc["paths"]["/api/v1/jobs/{job}"]["post"]["responses"]
        .as_object()
        .unwrap()
        .keys()
        .cloned()
        .collect();
    let errors = [
        EnqueueError::UnknownJob("x".into()),
        EnqueueError::Invalid { field: "key".into(), message: "m".into() },
        EnqueueError::TooLarge { job: "x".into(), size: 2, max: 1 },
        EnqueueError::NoSuchQueue { queue: "q".into(), detail: "d".into() },
        EnqueueError::NoWorkers { queue: "q".into() },
        EnqueueError::Redis("down".into()),
    ];
    let mut seen: BTreeSet<String> =
        errors.iter().map(|e| enqueue_error(e).status().as_u16().to_string()).collect();
    seen.extend(["202", "401", "403", "413", "415", "429"].map(String::from));
    for s in &seen {
        assert!(documented.contains(s), "status {s} is answered but not in openapi.json");
    }
}

#[test]
fn bodies_are_read_with_every_error_naming_its_field() {
    let ok = body::request(
        "j",
        br#"{"payload": {"a": 1}, "key": "k", "delay": "90s", "priority": "high", "max_attempts": 3}"#,
    )
    .unwrap();
    assert_eq!(ok.key.as_deref(), Some("k"));
    assert_eq!(ok.delay, Some(Duration::from_secs(90)));
    assert_eq!(body::request("j", b"").unwrap().payload, None);
    assert_eq!(body::request("j", br#"{"delay": 5}"#).unwrap().delay, Some(Duration::from_secs(5)));
    let bad = |b: &[u8]| body::request("j", b).unwrap_err();
    assert_eq!(bad(br#"{"max_attempts": "x"}"#).0.as_deref(), Some("max_attempts"));
    assert_eq!(bad(br#"{"max_attempts": -1}"#).0.as_deref(), Some("max_attempts"));
    assert_eq!(bad(br#"{"delay": "soon"}"#).0.as_deref(), Some("delay"));
    assert_eq!(bad(br#"{"at": "tomorrow"}"#).0.as_deref(), Some("at"));
    assert_eq!(bad(br#"{"at": "2026-01-01T00:00:00Z", "delay": 1}"#).0.as_deref(), Some("at"));
    assert_eq!(bad(br#"{"priority": "urgent"}"#).0.as_deref(), Some("priority"));
    assert_eq!(bad(br#"{"key": 5}"#).0.as_deref(), Some("key"));
    let (field, message) = bad(b"{\"key\": ");
    assert_eq!(field, None);
    assert!(message.contains("not valid JSON"), "{message}");
    assert!(bad(b"[1]").1.contains("bad body"));
    assert!(bad(br#"{"key": "a"} trailing"#).1.contains("not valid JSON"));
    // A delay that is neither a duration nor whole seconds says what it must be.
    for (body, says) in [
        (&br#"{"delay": 1.5}"#[..], "1.5: a delay is a whole number of seconds"),
        (br#"{"delay": -3}"#, "not negative"),
        (br#"{"delay": true}"#, "a whole number of seconds"),
    ] {
        let (field, message) = bad(body);
        assert_eq!(field.as_deref(), Some("delay"), "{message}");
        assert!(message.contains(says) && !message.contains("untagged"), "{message}");
    }
    assert_eq!(bad(br#"{"priority": "urgent"}"#).1, r#"priority "urgent": high, normal or low"#);
    // A byte order mark before the object is ignored (RFC 8259 allows it), in a batch too.
    let bom = |b: &[u8]| [&b"\xef\xbb\xbf"[..], b].concat();
    assert_eq!(body::request("j", &bom(br#"{"key": "k"}"#)).unwrap().key.as_deref(), Some("k"));
    assert_eq!(body::request("j", &bom(b"")).unwrap().key, None);
    assert_eq!(body::batch("j", &bom(br#"{"jobs": [{"key": "k"}]}"#)).unwrap().0.len(), 1);
}

#[test]
fn tokens_come_from_the_environment_and_are_checked() {
    let mut api = ApiConfig::default();
    let none = |_: &str| None;
    assert!(tokens(&api, none).unwrap_err().contains("CHIME_API_TOKEN"));
    let short = |k: &str| (k == "CHIME_API_TOKEN").then(|| "short".to_string());
    assert!(tokens(&api, short).unwrap_err().contains("16"));
    api.tokens.push(chime_shared::config::ApiToken {
        name: "billing".into(),
        env: "BILLING_TOKEN".into(),
        jobs: vec!["invoice".into()],
    });
    let missing = tokens(&api, |k: &str| (k == "CHIME_API_TOKEN").then(|| "x".repeat(20))).unwrap_err();
    assert!(missing.contains("billing") && missing.contains("BILLING_TOKEN"), "{missing}");
    let same = tokens(&api, |_: &str| Some("y".repeat(20))).unwrap_err();
    assert!(same.contains("same secret"), "{same}");
    let both = tokens(&api, |k: &str| Some(format!("{k}-0123456789abcdef"))).unwrap();
    assert!(both[0].allows("anything"));
    assert!(both[1].allows("invoice") && !both[1].allows("refund"));
}

#[test]
fn the_limiter_allows_a_burst_then_the_rate() {
    let limiter = Limiter {
        rate: Rate { limit: 3, per: Duration::from_secs(60), burst: 3 },
        next: Mutex::new(HashMap::new()),
    };
    for _ in 0..3 {
        limiter.take("a").unwrap();
    }
    let wait = limiter.take("a").unwrap_err();
    assert!(wait > Duration::from_secs(15) && wait <= Duration::from_secs(20), "{wait:?}");
    // Another token is not affected.
    limiter.take("b").unwrap();
}

#[test]
fn a_batch_body_names_the_element_at_fault() {
    let doc = doc();
    let props: BTreeSet<&str> = schema_fields(&doc, "BatchRequest");
    assert_eq!(props, body::BATCH_FIELDS.into_iter().collect(), "BatchRequest and the batch body differ");
    let (reqs, pack) = body::batch("j", br#"{"jobs": [{"key": "a"}, {}], "pack": 10}"#).unwrap();
    assert_eq!((reqs.len(), pack), (2, Some(10)));
    assert_eq!(reqs[0].key.as_deref(), Some("a"));
    let field = |b: &[u8]| body::batch("j", b).unwrap_err().0;
    assert_eq!(field(br#"{"jobs": [{}, {"priority": "urgent"}]}"#).as_deref(), Some("jobs[1].priority"));
    assert_eq!(field(br#"{"jobs": [{}, {"delay": "soon"}]}"#).as_deref(), Some("jobs[1].delay"));
    assert_eq!(field(br#"{"jobs": [{}, {}, {"paylod": 1}]}"#).as_deref(), Some("jobs[2].paylod"));
    assert_eq!(field(br#"{"jobs": [{"max_attempts": -1}]}"#).as_deref(), Some("jobs[0].max_attempts"));
    assert_eq!(field(br#"{"jobs": []}"#).as_deref(), Some("jobs"));
    assert_eq!(field(br#"{"jobz": []}"#).as_deref(), Some("jobz"));
    assert_eq!(field(br#"{"jobs": [{}], "pack": "ten"}"#).as_deref(), Some("pack"));
    assert_eq!(field(b"[]"), None);
    assert_eq!(field(b"{}"), None);
    // An element that is not an object says what it should be, not a Rust type's name.
    let (field, message) = body::batch("j", br#"{"jobs": [1]}"#).unwrap_err();
    assert_eq!(field.as_deref(), Some("jobs[0]"));
    assert!(
        message.contains(r#"expected an object such as {"payload": ..."#) && !message.contains("JobBody"),
        "{message}"
    );
}
