//! Migrations: in order, idempotent, recorded, and clean on a shop that already has its
//! business tables.

use crate::support::*;
use delay_worker::db;

#[test]
fn migrate_applies_once_and_records_it() {
    let d = TestDb::empty();
    let mut c = d.client();
    let first = db::migrate(&mut c).unwrap();
    assert_eq!(
        first,
        vec![
            "0001_shop_schema",
            "0002_worker_inbox",
            "0003_payment_review",
            "0004_worker_flush",
            "0005_inbox_job_id",
            "0006_inbox_outcome"
        ]
    );
    assert!(
        db::migrate(&mut c).unwrap().is_empty(),
        "second run applies nothing"
    );
    let n: i64 = c
        .query_one("SELECT count(*) FROM worker_migrations", &[])
        .unwrap()
        .get(0);
    assert_eq!(n, db::MIGRATIONS.len() as i64);
}

#[test]
fn migrate_keeps_an_existing_shop_schema_and_its_data() {
    let d = TestDb::empty();
    let mut c = d.client();
    // A shop's own tables: fewer columns than the reference, extra ones of its own.
    c.batch_execute(
        "CREATE TABLE coupon_user (id bigserial PRIMARY KEY, user_id bigint NOT NULL, status text NOT NULL, shop_note text);
         CREATE TABLE sku (id bigserial PRIMARY KEY, stock integer NOT NULL, title text);
         CREATE TABLE orders (id bigserial PRIMARY KEY, order_no text UNIQUE NOT NULL, status text NOT NULL,
                              coupon_id bigint, created_at timestamptz DEFAULT now(), total_cents bigint);
         CREATE TABLE order_items (id bigserial PRIMARY KEY, order_id bigint NOT NULL, sku_id bigint NOT NULL, qty int NOT NULL);
         INSERT INTO sku (stock, title) VALUES (5, 'tea');
         INSERT INTO coupon_user (user_id, status) VALUES (1, 'used');
         INSERT INTO orders (order_no, status, coupon_id, total_cents) VALUES ('SHOP-1', 'pending', 1, 990);
         INSERT INTO order_items (order_id, sku_id, qty) VALUES (1, 1, 2);",
    )
    .unwrap();
    // Concurrent migrators (two hosts starting at once) apply each migration once.
    let url = d.url.clone();
    let t = std::thread::spawn(move || {
        let mut c2 = postgres::Client::connect(&url, postgres::NoTls).unwrap();
        db::migrate(&mut c2).unwrap()
    });
    let mine = db::migrate(&mut c).unwrap();
    let theirs = t.join().unwrap();
    assert_eq!(mine.len() + theirs.len(), db::MIGRATIONS.len());

    let row = c
        .query_one(
            "SELECT total_cents, cancel_reason FROM orders WHERE order_no = 'SHOP-1'",
            &[],
        )
        .unwrap();
    assert_eq!(row.get::<_, Option<i64>>(0), Some(990), "shop data kept");
    assert_eq!(
        row.get::<_, Option<String>>(1),
        None,
        "handler column added"
    );
    let title: String = c.query_one("SELECT title FROM sku", &[]).unwrap().get(0);
    assert_eq!(title, "tea");
    let n: i64 = c
        .query_one("SELECT count(*) FROM information_schema.tables WHERE table_name IN ('aftersale', 'worker_inbox')", &[])
        .unwrap()
        .get(0);
    assert_eq!(n, 2, "absent tables created");
}
