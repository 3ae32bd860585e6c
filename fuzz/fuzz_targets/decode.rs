//! Message decoding and validation never panic, whatever the bytes, and a decoded message
//! survives the retry round trip (re-encoded, decoded again, retry raised by one).
#![no_main]

use delay_worker::message::Envelope;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let limit = 64 * 1024;
    if let Ok(env) = Envelope::decode(data, limit) {
        let required = [vec!["order_id".to_string(), "order_no".to_string()]];
        let _ = env.require(&required);
        let next = env.next_retry();
        let again = Envelope::decode(next.as_bytes(), usize::MAX).expect("a retried message decodes");
        assert_eq!(again.event, env.event);
        assert_eq!(again.payload, env.payload);
        assert_eq!(again.retry, env.retry.saturating_add(1));
    }
    if let Ok(env) = Envelope::decode_raw(data, limit, "payment.paid") {
        assert_eq!(env.event, "payment.paid");
        Envelope::decode(env.next_retry().as_bytes(), usize::MAX).expect("a raw message re-queues as an envelope");
    }
    let key = delay_worker::workers::key_text(data);
    assert!(!key.contains('\0'));
    let _ = delay_worker::message::event_of(data);
});
