-- The reference shop schema: the names the built-in handlers rely on.
-- Shops usually have these tables already, so every statement is "if not exists": a table
-- that exists is kept as it is, and only the columns the handlers need are added to it.

CREATE TABLE IF NOT EXISTS coupon_user (
    id          bigserial PRIMARY KEY,
    user_id     bigint NOT NULL,
    status      text NOT NULL DEFAULT 'unused',      -- unused | used | expired
    used_at     timestamptz,
    expire_at   timestamptz,
    updated_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE IF NOT EXISTS sku (
    id          bigserial PRIMARY KEY,
    stock       integer NOT NULL DEFAULT 0,
    updated_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE IF NOT EXISTS orders (
    id            bigserial PRIMARY KEY,
    order_no      text NOT NULL UNIQUE,
    user_id       bigint,
    status        text NOT NULL DEFAULT 'pending',   -- pending | paid | cancelled
    coupon_id     bigint REFERENCES coupon_user (id),
    cancel_reason text,
    cancelled_at  timestamptz,
    paid_at       timestamptz,
    created_at    timestamptz NOT NULL DEFAULT now(),
    updated_at    timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE IF NOT EXISTS order_items (
    id        bigserial PRIMARY KEY,
    order_id  bigint NOT NULL REFERENCES orders (id),
    sku_id    bigint NOT NULL REFERENCES sku (id),
    qty       integer NOT NULL CHECK (qty > 0)
);

CREATE TABLE IF NOT EXISTS aftersale (
    id              bigserial PRIMARY KEY,
    order_id        bigint NOT NULL REFERENCES orders (id),
    status          text NOT NULL DEFAULT 'pending', -- pending | approved | rejected | ...
    deadline_at     timestamptz,
    resolved_at     timestamptz,
    resolve_reason  text
);

-- Columns the handlers write, added to a shop table that predates them.
ALTER TABLE orders ADD COLUMN IF NOT EXISTS cancel_reason text;
ALTER TABLE orders ADD COLUMN IF NOT EXISTS cancelled_at timestamptz;
ALTER TABLE orders ADD COLUMN IF NOT EXISTS paid_at timestamptz;
ALTER TABLE orders ADD COLUMN IF NOT EXISTS updated_at timestamptz NOT NULL DEFAULT now();
ALTER TABLE sku ADD COLUMN IF NOT EXISTS updated_at timestamptz NOT NULL DEFAULT now();
ALTER TABLE coupon_user ADD COLUMN IF NOT EXISTS used_at timestamptz;
ALTER TABLE coupon_user ADD COLUMN IF NOT EXISTS expire_at timestamptz;
ALTER TABLE coupon_user ADD COLUMN IF NOT EXISTS updated_at timestamptz NOT NULL DEFAULT now();
ALTER TABLE aftersale ADD COLUMN IF NOT EXISTS deadline_at timestamptz;
ALTER TABLE aftersale ADD COLUMN IF NOT EXISTS resolved_at timestamptz;
ALTER TABLE aftersale ADD COLUMN IF NOT EXISTS resolve_reason text;

-- The order.timeout handler finds an order's items by order id.
CREATE INDEX IF NOT EXISTS order_items_order_id_idx ON order_items (order_id);
