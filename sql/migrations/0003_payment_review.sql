-- Payments that could not be applied: the order was already cancelled by its timeout (the
-- user paid just as it expired) or does not exist. They need a refund or a person's look,
-- so they are recorded here, never dropped.
CREATE TABLE IF NOT EXISTS payment_review (
    id           bigserial PRIMARY KEY,
    order_id     bigint,
    order_no     text,
    payload      jsonb NOT NULL,
    reason       text NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    resolved_at  timestamptz
);

CREATE INDEX IF NOT EXISTS payment_review_open_idx ON payment_review (created_at) WHERE resolved_at IS NULL;
